// The REGEMM_* environment variables, read one way everywhere (at every
// call, so that a test or a user can change them between calls): a variable
// is off when set to 0, off or false, and on when set to anything else.
#pragma once

#include <cstdlib>
#include <cstring>

namespace regemm {

inline bool env_off(const char* name) {
  const char* v = std::getenv(name);
  return v && (std::strcmp(v, "0") == 0 || std::strcmp(v, "off") == 0 || std::strcmp(v, "false") == 0);
}

inline bool env_on(const char* name) {
  const char* v = std::getenv(name);
  return v && *v && !env_off(name);
}

}  // namespace regemm

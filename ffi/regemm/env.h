// The REGEMM_* run-time switches, read one way everywhere (at every call, so
// that a test or a user can change them between calls). A switch is off when
// set to 0, off, false or no and on when set to 1, on, true or yes, in any
// case; these are the spellings jax_regemm/_env.py accepts, and that module,
// which lists every variable (docs/environment.md), rejects any other value
// when a program is lowered, before a handler reads it.
#pragma once

#include <cstdlib>
#include <strings.h>

namespace regemm {

inline bool env_is(const char* name, const char* const* spellings) {
  const char* v = std::getenv(name);
  if (!v) return false;
  for (; *spellings; ++spellings)
    if (strcasecmp(v, *spellings) == 0) return true;
  return false;
}

inline bool env_off(const char* name) {
  static const char* const kOff[] = {"0", "off", "false", "no", nullptr};
  return env_is(name, kOff);
}

inline bool env_on(const char* name) {
  static const char* const kOn[] = {"1", "on", "true", "yes", nullptr};
  return env_is(name, kOn);
}

}  // namespace regemm

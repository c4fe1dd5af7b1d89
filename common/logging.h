// Process-wide logging setup (glog). Call once from main().
#pragma once

namespace penumbra {

// Initializes glog: logs to stderr, INFO and above unless --minloglevel says
// otherwise. Safe to call more than once.
void InitLogging(const char* argv0);

}  // namespace penumbra

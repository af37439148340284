// The moefq executable the CLI tests run: tests/CMakeLists.txt defines its path as MOEFQ_BINARY.
#pragma once

#include <string>

#include "cli_test_util.h"

#ifndef MOEFQ_BINARY
#error "MOEFQ_BINARY (the path of the moefq executable) must be defined by tests/CMakeLists.txt"
#endif

namespace moefq::test {

// The shell command that runs moefq with `args` (quoted by the caller where needed).
inline std::string moefq_command(const std::string& args) { return quote(MOEFQ_BINARY) + " " + args; }

}  // namespace moefq::test

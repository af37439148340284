#include "cli/commands.h"

#include <cstdio>

namespace moefq::cli {
int run(int, char**) {
  std::puts("moefq");
  return 0;
}
}  // namespace moefq::cli

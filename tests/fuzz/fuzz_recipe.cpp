// libFuzzer target for the recipe loader: any text either parses or is rejected with
// moefq::Error; another exception, a hang or a sanitizer report is a bug.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "moefq/errors.h"
#include "moefq/recipe.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    (void)moefq::parse_recipe_text(std::string_view(reinterpret_cast<const char*>(data), size),
                                   "fuzz.yaml");
  } catch (const moefq::Error&) {
    // Expected for malformed recipes.
  }
  return 0;
}

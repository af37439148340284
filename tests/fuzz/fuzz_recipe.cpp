// libFuzzer target for the recipe loader and schema: any text (in any of Model Optimizer's layouts;
// its imports resolve against the shipped recipes) either parses or is rejected with moefq::Error;
// another exception, a hang or a sanitizer report is a bug. Each parsed recipe is also applied to
// two layers' quantizer names.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "moefq/errors.h"
#include "moefq/recipe.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const moefq::Recipe r =
        moefq::parse_recipe_text(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz.yaml");
    (void)moefq::ignored_entries_notice(r);
    (void)moefq::apply_recipe(r, {"layers.0.mlp.experts.dispatch_quantizer", "layers.0.mlp.experts.combine_quantizer",
                                  "layers.1.mlp.experts.dispatch_quantizer", "layers.1.mlp.experts.combine_quantizer"});
  } catch (const moefq::Error&) {
    // Expected for malformed recipes.
  }
  return 0;
}

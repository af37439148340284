// The calibration file of `moefq calibrate --save` / `moefq eval --load-calibration`: the shared
// calibration file (moefq/calibration_file.h) with format-independent entries (max calibration
// measures max |x|, which serves every recipe), each rank's own max, and the setup it was
// measured on, which a later run compares with its own.
#include <cmath>

#include "eval/layer_runner.h"
#include "moefq/calibration_file.h"
#include "moefq/errors.h"
#include "moefq/fake_quant_moe.h"

namespace moefq {
namespace {

std::string layer_list(const std::vector<int64_t>& layers) {
  std::string s;
  for (int64_t l : layers) {
    if (!s.empty()) s += ',';
    s += std::to_string(l);
  }
  return s;
}

// What the amax depends on, as the file records it.
std::vector<std::pair<std::string, std::string>> setup_fields(const EvalSetup& s) {
  return {{"model", s.model_source},
          {"model_name", s.config.name},
          {"hidden", std::to_string(s.config.hidden)},
          {"num_experts", std::to_string(s.config.num_experts)},
          {"top_k", std::to_string(s.config.top_k)},
          {"layers", layer_list(s.layers)},
          {"weights", s.weights_source},
          {"activations", s.activations_source},
          {"synthetic", s.synthetic},
          {"ranks", std::to_string(s.ranks)},
          {"tokens_per_rank", std::to_string(s.tokens)},
          {"calib_batches", std::to_string(s.calib_batches)},
          {"seed", std::to_string(s.seed)},
          {"combine_weighting", combine_weighting_name(s.combine_weighting)},
          // The combine rows (and their amax) change a little with the staging: a file of the other
          // staging is used with a warning.
          {"staging", staging_name(s.staging)}};
}

}  // namespace

void save_eval_calibration(const std::string& path, const CalibrationState& state, const EvalSetup& setup) {
  CalibrationFile f;
  f.source = state.source;
  f.algorithm = state.algorithm;
  f.setup = setup_fields(setup);
  for (const LayerCalibration& l : state.layers) {
    for (int which = 0; which < 2; ++which) {
      CalibrationEntry e;  // no format: the amax serves every recipe
      e.amax = which == 0 ? l.dispatch_amax : l.combine_amax;
      if (state.algorithm == "max") e.rank_amax = which == 0 ? l.dispatch_rank_amax : l.combine_rank_amax;
      f.quantizers[which == 0 ? FakeQuantMoe::dispatch_name(l.layer) : FakeQuantMoe::combine_name(l.layer)] = e;
    }
  }
  write_calibration_file(path, f);
}

CalibrationState load_eval_calibration(const std::string& path, const EvalSetup& setup,
                                       std::vector<std::string>* warnings) {
  const std::string where = "--load-calibration " + path;
  const CalibrationFile f = read_calibration_file(path, where);
  // The setup keys the amax's use depends on must be there, integers as JSON integers; the model's
  // shape first, as an amax of another model is meaningless.
  const auto value = [&](const std::string& key, bool integer) {
    const std::string* v = f.setup_value(key);
    MOEFQ_CHECK(v != nullptr, where, ": the setup has no '", key,
                "' (a file of 'moefq calibrate --save' records it); calibrate again");
    MOEFQ_CHECK(!integer || f.setup_is_integer(key), where, ": setup.", key, " must be a JSON integer, got the string \"",
                *v, "\"");
    return *v;
  };
  for (const auto& [key, want] : {std::pair<const char*, int64_t>{"hidden", setup.config.hidden},
                                  {"num_experts", setup.config.num_experts},
                                  {"top_k", setup.config.top_k}}) {
    const std::string v = value(key, true);
    MOEFQ_CHECK(v == std::to_string(want), where, ": the file was made for a model with ", key, " ", v,
                ", but this run's model (", setup.config.name, ") has ", want);
  }
  const std::string ranks_text = value("ranks", true);
  for (const char* key : {"tokens_per_rank", "calib_batches", "seed"})
    if (f.setup_value(key)) (void)value(key, true);
  // The combine rows, and so their amax, depend on where the router weight is applied.
  const std::string mode = combine_weighting_name(setup.combine_weighting);
  const std::string file_mode = value("combine_weighting", false);
  MOEFQ_CHECK(file_mode == mode, where, ": the file was calibrated with combine_weighting ", file_mode,
              ", but this run applies the router weight ", mode, " the combine (--combine-weighting or the recipes); the combine amax of one mode is wrong for the "
              "other: calibrate with --combine-weighting ", mode);
  // The rest may differ (a calibration reused on other data is a choice), but never silently.
  std::vector<std::string> differ;
  for (const auto& [key, mine] : setup_fields(setup)) {
    if (key == "hidden" || key == "num_experts" || key == "top_k" || key == "layers" || key == "combine_weighting")
      continue;
    const std::string* theirs = f.setup_value(key);
    if (theirs && *theirs != mine) differ.push_back(key + " '" + *theirs + "' (this run: '" + mine + "')");
  }
  if (!differ.empty() && warnings) {
    std::string list;
    for (const std::string& d : differ) list += (list.empty() ? "" : "; ") + d;
    warnings->push_back(where + " was made with a different setup: " + list);
  }
  CalibrationState state;
  state.source = "loaded from " + path + (f.source.empty() ? "" : " (" + f.source + ")");
  state.algorithm = f.algorithm;
  for (int64_t l : setup.layers) {
    LayerCalibration c;
    c.layer = l;
    for (int which = 0; which < 2; ++which) {
      const std::string name = which == 0 ? FakeQuantMoe::dispatch_name(l) : FakeQuantMoe::combine_name(l);
      const auto it = f.quantizers.find(name);
      MOEFQ_CHECK(it != f.quantizers.end(), where, ": no calibration for layer ", l, " (", name,
                  "); calibrate that layer (moefq calibrate --layers ...) and save again");
      const CalibrationEntry& e = it->second;
      MOEFQ_CHECK(e.amax_source == "calibrated" && e.amax.has_value(), where, ": ", name,
                  " holds no calibrated amax");
      MOEFQ_CHECK(*e.amax > 0 && std::isfinite(*e.amax), where, ": ", name, " has amax ", *e.amax,
                  "; a calibrated amax must be finite and > 0 (calibrate again)");
      MOEFQ_CHECK(e.rank_amax.empty() || std::to_string(e.rank_amax.size()) == ranks_text, where, ": ",
                  name, " has ", e.rank_amax.size(), " per-rank maxima but the file's setup has ",
                  ranks_text, " ranks");
      (which == 0 ? c.dispatch_amax : c.combine_amax) = *e.amax;
      (which == 0 ? c.dispatch_rank_amax : c.combine_rank_amax) = e.rank_amax;
    }
    state.layers.push_back(std::move(c));
  }
  return state;
}

}  // namespace moefq

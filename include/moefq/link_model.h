// Wire bytes into transfer time: the dispatch or combine of one batch over an expert-parallel
// link, as a first-order model (docs/eval.md "Transfer time"):
//   rows sent per rank = tokens x D x (R - 1) / R, D = R (1 - (1 - 1/R)^K) the expected number of
//                        distinct ranks a token's K routed experts lie on under uniform routing
//                        (a token goes once to each destination rank; (R - 1) / R of them are
//                        other ranks; 0 for R = 1),
//   time = rows x bytes per row / bandwidth + latency (no latency when nothing is sent),
// every rank sending at once over its own link (the time of one rank is the batch's). The combine
// sends the same number of rows back. Bandwidth and latency are the named link's nominal figures
// (per GPU, one direction), not measurements: they rank formats, they do not predict a kernel.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moefq {

struct LinkModel {
  std::string name;         // "nvlink4", ..., "custom"; empty: no link (no times)
  double gbit_per_s = 0;    // per GPU, one direction (gigabits: 1e9 bits per second)
  double latency_us = 0;    // per transfer
  bool enabled() const { return !name.empty(); }
  std::string describe() const;  // "nvlink4 (3600 Gbit/s, 3 us)"
};

struct NamedLink {
  const char* name;
  double gbit_per_s, latency_us;
  const char* what;
};
// The named links (docs/eval.md lists them with their sources).
const std::vector<NamedLink>& named_links();
std::string link_choices();  // "nvlink4|nvlink5|..."

// The link of `--link NAME` or `--link-gbps G` (at most one; neither: disabled); bad input naming
// the option otherwise.
LinkModel make_link_model(const std::string& name, double gbps);

// D of the model above.
double mean_destination_ranks(int64_t ranks, int64_t top_k);
// Microseconds one rank needs to send its rows of `tokens_per_rank` tokens at `bytes_per_row`.
double transfer_us(const LinkModel& link, double bytes_per_row, int64_t tokens_per_rank, int64_t ranks, int64_t top_k);

}  // namespace moefq

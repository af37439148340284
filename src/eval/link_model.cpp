// The link model of include/moefq/link_model.h.
#include "moefq/link_model.h"

#include <cmath>
#include <cstdio>

#include "moefq/errors.h"

namespace moefq {

const std::vector<NamedLink>& named_links() {
  // Nominal per-GPU, per-direction rates: NVLink 4 (H100) 900 GB/s and NVLink 5 (B200) 1.8 TB/s
  // both directions together; InfiniBand NDR/XDR one NIC per GPU (400 / 800 Gbit/s). Latencies are
  // round figures for one transfer (NVLink a few microseconds, an RDMA write over a switch more).
  static const std::vector<NamedLink> links = {
      {"nvlink4", 3600, 3, "NVLink 4 (H100): 450 GB/s per direction"},
      {"nvlink5", 7200, 3, "NVLink 5 (B200): 900 GB/s per direction"},
      {"ib200", 200, 5, "InfiniBand HDR, 200 Gbit/s per GPU"},
      {"ib400", 400, 5, "InfiniBand NDR, 400 Gbit/s per GPU"},
      {"ib800", 800, 5, "InfiniBand XDR, 800 Gbit/s per GPU"},
  };
  return links;
}

std::string link_choices() {
  std::string s;
  for (const NamedLink& l : named_links()) {
    if (!s.empty()) s += '|';
    s += l.name;
  }
  return s;
}

std::string LinkModel::describe() const {
  char buf[96];
  std::snprintf(buf, sizeof buf, " (%.6g Gbit/s, %.6g us)", gbit_per_s, latency_us);
  return name + buf;
}

LinkModel make_link_model(const std::string& name, double gbps) {
  LinkModel m;
  MOEFQ_CHECK(name.empty() || gbps == 0, "--link and --link-gbps cannot be used together");
  if (!name.empty()) {
    for (const NamedLink& l : named_links())
      if (name == l.name) return LinkModel{l.name, l.gbit_per_s, l.latency_us};
    MOEFQ_FAIL(ErrorKind::kBadInput, "--link '", name, "' is not a known link (", link_choices(),
               "; or give --link-gbps)");
  }
  if (gbps != 0) {
    MOEFQ_CHECK(std::isfinite(gbps) && gbps > 0 && gbps <= 1e6, "--link-gbps must be a number > 0 (gigabits per ",
                "second per GPU, one direction), got ", gbps);
    m.name = "custom";
    m.gbit_per_s = gbps;
  }
  return m;
}

double mean_destination_ranks(int64_t ranks, int64_t top_k) {
  MOEFQ_ASSERT(ranks >= 1 && top_k >= 1, "mean_destination_ranks: bad shape");
  const double R = double(ranks);
  return R * (1.0 - std::pow(1.0 - 1.0 / R, double(top_k)));
}

double transfer_us(const LinkModel& link, double bytes_per_row, int64_t tokens_per_rank, int64_t ranks, int64_t top_k) {
  if (!link.enabled() || ranks <= 1) return 0.0;
  const double rows = double(tokens_per_rank) * mean_destination_ranks(ranks, top_k) * double(ranks - 1) / double(ranks);
  const double bytes = rows * bytes_per_row;
  if (!(bytes > 0)) return 0.0;
  return bytes / (link.gbit_per_s * 1e9 / 8.0) * 1e6 + link.latency_us;
}

}  // namespace moefq

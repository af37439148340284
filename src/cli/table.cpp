#include "cli/table.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace moefq::cli {

void Table::print(std::FILE* out) const {
  std::vector<size_t> width;
  for (const auto& row : rows_)
    for (size_t c = 0; c < row.size(); ++c) {
      if (width.size() <= c) width.push_back(0);
      width[c] = std::max(width[c], row[c].size());
    }
  auto numeric = [](const std::string& s) {
    return !s.empty() && (std::isdigit(static_cast<unsigned char>(s[0])) || s[0] == '-' || s[0] == '+' ||
                          s == "inf" || s == "nan");
  };
  for (size_t r = 0; r < rows_.size(); ++r) {
    std::string line;
    for (size_t c = 0; c < rows_[r].size(); ++c) {
      const std::string& cell = rows_[r][c];
      const std::string pad(width[c] - cell.size(), ' ');
      line += (r > 0 && numeric(cell)) ? pad + cell : cell + pad;
      if (c + 1 < rows_[r].size()) line += "  ";
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    std::fprintf(out, "%s\n", line.c_str());
    if (r == 0) {
      size_t total = 0;
      for (size_t w : width) total += w + 2;
      std::fprintf(out, "%s\n", std::string(total > 2 ? total - 2 : 0, '-').c_str());
    }
  }
}

std::string fmt_num(double v, int digits) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*g", digits, v);
  return buf;
}

std::string fmt_fixed(double v, int decimals) {
  if (!std::isfinite(v)) return fmt_num(v);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

}  // namespace moefq::cli

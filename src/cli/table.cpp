#include "cli/table.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "moefq/fileio.h"

namespace moefq::cli {

namespace {

bool numeric(const std::string& s) {
  return !s.empty() && (std::isdigit(static_cast<unsigned char>(s[0])) || s[0] == '-' || s[0] == '+' || s == "inf" ||
                        s == "nan");
}

}  // namespace

void Table::add(std::vector<std::string> row) {
  for (std::string& cell : row) cell = terminal_safe(cell);
  rows_.push_back(std::move(row));
}

std::vector<std::string> Table::lines() const {
  std::vector<size_t> width;
  // A column of words: some cell below its header that is no number and no "-".
  std::vector<bool> words;
  for (size_t r = 0; r < rows_.size(); ++r)
    for (size_t c = 0; c < rows_[r].size(); ++c) {
      if (width.size() <= c) {
        width.push_back(0);
        words.push_back(false);
      }
      const std::string& cell = rows_[r][c];
      width[c] = std::max(width[c], cell.size());
      if (r > 0 && !numeric(cell)) words[c] = true;
    }
  const std::string gap(size_t(std::max(gap_, 1)), ' ');
  std::vector<std::string> out;
  for (size_t r = 0; r < rows_.size(); ++r) {
    std::string line;
    for (size_t c = 0; c < rows_[r].size(); ++c) {
      const std::string& cell = rows_[r][c];
      const std::string pad(width[c] - cell.size(), ' ');
      const bool right = r > 0 && numeric(cell) && !(cell == "-" && words[c]);
      line += right ? pad + cell : cell + pad;
      if (c + 1 < rows_[r].size()) line += gap;
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out.push_back(line);
    if (r == 0) {
      size_t total = 0;
      for (size_t w : width) total += w + gap.size();
      out.push_back(std::string(total > gap.size() ? total - gap.size() : 0, '-'));
    }
  }
  return out;
}

void Table::print(std::FILE* out) const {
  for (const std::string& line : lines()) std::fprintf(out, "%s\n", line.c_str());
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

std::string join(const std::vector<std::string>& parts, const std::string& sep) {
  std::string s;
  for (size_t i = 0; i < parts.size(); ++i) s += (i ? sep : "") + parts[i];
  return s;
}

std::vector<std::string> wrap_text(const std::string& first, const std::string& indent, const std::string& text,
                                   size_t width) {
  std::vector<std::string> out;
  std::string line = first;
  bool empty = true;  // no word on `line` yet
  std::istringstream words(text);
  for (std::string w; words >> w;) {
    if (!empty && line.size() + 1 + w.size() > width) {
      out.push_back(line);
      line = indent;
      empty = true;
    }
    line += (empty ? "" : " ") + w;
    empty = false;
  }
  out.push_back(line);
  return out;
}

}  // namespace moefq::cli

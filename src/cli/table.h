// A plain text table: columns sized to their widest cell, numbers right-aligned.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

namespace moefq::cli {

class Table {
 public:
  explicit Table(std::vector<std::string> header) : rows_{std::move(header)} {}
  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  void print(std::FILE* out = stdout) const;

 private:
  std::vector<std::vector<std::string>> rows_;
};

// "%.4g"-style formatting used by every table; "inf"/"nan" spelled out.
std::string fmt_num(double v, int digits = 4);
std::string fmt_fixed(double v, int decimals);

}  // namespace moefq::cli

// A plain text table: columns sized to their widest cell, numbers right-aligned, a rule under the
// header. A "-" cell (no value) is right-aligned like a number, except in a column of words
// (one with a cell that is neither), where it is left-aligned like them.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

namespace moefq::cli {

class Table {
 public:
  // gap: the spaces between two columns.
  explicit Table(std::vector<std::string> header, int gap = 2) : rows_{std::move(header)}, gap_(gap) {}
  // A row; its cells are printed escaped (terminal_safe): names from files cannot drive the terminal.
  void add(std::vector<std::string> row);
  // The header, its rule and the rows, without trailing spaces or newlines.
  std::vector<std::string> lines() const;
  void print(std::FILE* out = stdout) const;

 private:
  std::vector<std::vector<std::string>> rows_;
  int gap_;
};

// "%.4g"-style formatting used by every table; "inf"/"nan" spelled out.
std::string fmt_num(double v, int digits = 4);
std::string fmt_fixed(double v, int decimals);

// The parts with `sep` between them: join({"a", "b"}, ", ") is "a, b".
std::string join(const std::vector<std::string>& parts, const std::string& sep);

// `text` broken at spaces into lines of at most `width` characters, the first starting with
// `first`, the others with `indent` (a word longer than a line stays whole).
std::vector<std::string> wrap_text(const std::string& first, const std::string& indent, const std::string& text,
                                   size_t width);

}  // namespace moefq::cli

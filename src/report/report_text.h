// Text helpers the report writers share: numbers as text (snprintf, never iostreams; non-finite
// values spelled inf, -inf, nan), the generation time stamp, and HTML escaping.
#pragma once

#include <string>

namespace moefq::report {

// v printed with the printf conversion spec ("%.4g" unless given).
std::string fmt(double v, const char* spec = "%.4g");
// Now, UTC, to the second: "2026-12-06T21:22:15Z".
std::string utc_now();
// s with & < > " ' escaped, for HTML text and attribute values.
std::string esc(const std::string& s);

}  // namespace moefq::report

#include "table.h"

#include <algorithm>
#include <cstdio>
#include <iomanip>
#include <sstream>

namespace flamia::cli {

std::string fmt(double x, int precision) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(precision) << x;
  return os.str();
}

std::string fmt_sci(double x, int precision) {
  std::ostringstream os;
  os << std::scientific << std::setprecision(precision) << x;
  return os.str();
}

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out;
}

namespace {

// Columns a UTF-8 string takes in a terminal (one per code point: no wide characters here).
size_t display_width(const std::string& s) {
  size_t n = 0;
  for (char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}

}  // namespace

void Table::print_text(std::ostream& os) const {
  std::vector<size_t> width(columns.size());
  for (size_t c = 0; c < columns.size(); ++c) width[c] = display_width(columns[c]);
  for (const auto& r : rows)
    for (size_t c = 0; c < r.size() && c < width.size(); ++c)
      width[c] = std::max(width[c], display_width(r[c]));
  if (!title.empty()) os << title << "\n";
  auto line = [&](const std::vector<std::string>& cells) {
    for (size_t c = 0; c < width.size(); ++c) {
      const std::string& s = c < cells.size() ? cells[c] : std::string();
      // First column left-aligned (names), the rest right-aligned (numbers).
      const size_t pad = width[c] - display_width(s);
      if (c == 0) {
        os << s << std::string(pad, ' ');
      } else {
        os << "  " << std::string(pad, ' ') << s;
      }
    }
    os << "\n";
  };
  line(columns);
  size_t total = 0;
  for (size_t w : width) total += w + 2;
  os << std::string(total - 2, '-') << "\n";
  for (const auto& r : rows) line(r);
  for (const auto& n : notes) os << n << "\n";
}

void Table::print_csv(std::ostream& os) const {
  auto line = [&](const std::vector<std::string>& cells) {
    for (size_t c = 0; c < cells.size(); ++c) {
      bool quote = cells[c].find_first_of(",\"") != std::string::npos;
      if (c) os << ",";
      if (quote) {
        std::string q;
        for (char ch : cells[c]) q += ch == '"' ? std::string("\"\"") : std::string(1, ch);
        os << '"' << q << '"';
      } else {
        os << cells[c];
      }
    }
    os << "\n";
  };
  line(columns);
  for (const auto& r : rows) line(r);
}

void Table::print_json(std::ostream& os) const {
  auto list = [&](const std::vector<std::string>& v) {
    os << "[";
    for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << '"' << json_escape(v[i]) << '"';
    os << "]";
  };
  os << "{\"title\": \"" << json_escape(title) << "\", \"columns\": ";
  list(columns);
  os << ", \"rows\": [";
  for (size_t r = 0; r < rows.size(); ++r) {
    os << (r ? ", " : "");
    list(rows[r]);
  }
  os << "], \"notes\": ";
  list(notes);
  os << "}";
}

void print_json(std::ostream& os, const std::vector<Table>& tables) {
  os << "{\"tables\": [";
  for (size_t i = 0; i < tables.size(); ++i) {
    os << (i ? ",\n" : "\n");
    tables[i].print_json(os);
  }
  os << "\n]}\n";
}

}  // namespace flamia::cli

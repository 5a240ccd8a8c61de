// Result tables for the CLI: one structure printed as aligned text, CSV or JSON, so `--json`
// prints exactly the numbers of the text table.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace flamia::cli {

struct Table {
  std::string title;
  std::vector<std::string> columns;
  std::vector<std::vector<std::string>> rows;
  std::vector<std::string> notes;  // printed under the text table, carried in JSON

  void add_row(std::vector<std::string> row) { rows.push_back(std::move(row)); }
  void print_text(std::ostream& os) const;
  void print_csv(std::ostream& os) const;
  void print_json(std::ostream& os) const;  // {"title":..., "columns":[...], "rows":[[...]], ...}
};

// Several tables as one JSON document: {"tables": [...]}.
void print_json(std::ostream& os, const std::vector<Table>& tables);

std::string fmt(double x, int precision = 4);      // fixed notation
std::string fmt_sci(double x, int precision = 2);  // scientific notation
std::string json_escape(const std::string& s);

}  // namespace flamia::cli

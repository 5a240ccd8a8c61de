// A small command-line option parser for the `flamia` subcommands: `--name value`, `--name=value`
// and boolean `--flag`. Every subcommand declares its options (with help text and defaults), so
// `--help` is generated from the same table that parsing uses and cannot drift from it.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace flamia::cli {

struct OptionSpec {
  std::string name;           // without the leading dashes
  std::string default_value;  // "" for flags (false) and for options without default
  std::string help;
  bool is_flag = false;
};

class Args {
 public:
  // Parses argv[first..argc); throws flamia::Error on unknown options or missing values.
  Args(std::string command, std::string summary, std::vector<OptionSpec> specs, int argc,
       char** argv, int first);

  bool help_requested() const { return help_; }
  std::string usage() const;

  bool flag(const std::string& name) const;
  // Whether the command line set the option (a default does not count).
  bool given(const std::string& name) const;
  std::string str(const std::string& name) const;
  int64_t integer(const std::string& name) const;
  double real(const std::string& name) const;
  // Comma-separated integers ("300,77,650").
  std::vector<int64_t> integers(const std::string& name) const;
  std::vector<std::string> strings(const std::string& name) const;
  const std::vector<std::string>& positional() const { return positional_; }

 private:
  const OptionSpec& spec(const std::string& name) const;
  std::string command_, summary_;
  std::vector<OptionSpec> specs_;
  std::map<std::string, std::string> values_;
  std::set<std::string> given_;
  std::vector<std::string> positional_;
  bool help_ = false;
};

}  // namespace flamia::cli

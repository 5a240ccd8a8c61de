#include "args.h"

#include <cstdlib>
#include <sstream>

#include "flamia/common.h"

namespace flamia::cli {

Args::Args(std::string command, std::string summary, std::vector<OptionSpec> specs, int argc,
           char** argv, int first)
    : command_(std::move(command)), summary_(std::move(summary)), specs_(std::move(specs)) {
  for (const OptionSpec& s : specs_)
    if (!s.is_flag && !s.default_value.empty()) values_[s.name] = s.default_value;
  for (int i = first; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      help_ = true;
      continue;
    }
    if (a.rfind("--", 0) != 0) {
      positional_.push_back(a);
      continue;
    }
    std::string name = a.substr(2), value;
    bool has_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    const OptionSpec& s = spec(name);
    given_.insert(name);
    if (s.is_flag) {
      if (has_value) throw Error("--" + name + " is a flag and takes no value");
      values_[name] = "1";
      continue;
    }
    if (!has_value) {
      if (i + 1 >= argc) throw Error("--" + name + " needs a value");
      value = argv[++i];
    }
    values_[name] = value;
  }
}

const OptionSpec& Args::spec(const std::string& name) const {
  for (const OptionSpec& s : specs_)
    if (s.name == name) return s;
  throw Error("unknown option --" + name + " for 'flamia " + command_ + "' (see --help)");
}

std::string Args::usage() const {
  std::ostringstream os;
  os << "usage: flamia " << command_ << " [options]\n\n" << summary_ << "\n\noptions:\n";
  for (const OptionSpec& s : specs_) {
    std::string left = "  --" + s.name + (s.is_flag ? "" : " VALUE");
    os << left << std::string(left.size() < 28 ? 28 - left.size() : 1, ' ') << s.help;
    if (!s.is_flag && !s.default_value.empty()) os << " (default: " << s.default_value << ")";
    os << "\n";
  }
  os << "  --help                    this text\n";
  return os.str();
}

bool Args::flag(const std::string& name) const {
  spec(name);
  return values_.count(name) != 0;
}

bool Args::given(const std::string& name) const {
  spec(name);
  return given_.count(name) != 0;
}

std::string Args::str(const std::string& name) const {
  spec(name);
  auto it = values_.find(name);
  return it == values_.end() ? std::string() : it->second;
}

int64_t Args::integer(const std::string& name) const {
  std::string v = str(name);
  char* end = nullptr;
  long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0') throw Error("--" + name + " expects an integer, got '" + v + "'");
  return x;
}

double Args::real(const std::string& name) const {
  std::string v = str(name);
  char* end = nullptr;
  double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0') throw Error("--" + name + " expects a number, got '" + v + "'");
  return x;
}

std::vector<std::string> Args::strings(const std::string& name) const {
  std::vector<std::string> out;
  std::stringstream ss(str(name));
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

std::vector<int64_t> Args::integers(const std::string& name) const {
  std::vector<int64_t> out;
  for (const std::string& item : strings(name)) {
    char* end = nullptr;
    long long x = std::strtoll(item.c_str(), &end, 10);
    if (*end != '\0')
      throw Error("--" + name + " expects comma-separated integers, got '" + item + "'");
    out.push_back(x);
  }
  return out;
}

}  // namespace flamia::cli

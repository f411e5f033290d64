// CLI11 behind bench::CommandLine (Note [One compiled command-line parser]).
#include "bench_cli.h"

#include <CLI/CLI.hpp>

#include <cstdlib>
#include <stdexcept>

namespace bench {

struct CommandLine::Impl {
  explicit Impl(const std::string& description) : app(description) {}
  CLI::App app;
  CLI::Option* last = nullptr;

  template <typename T>
  void add(const std::string& name, T* value, const std::string& help) {
    last = app.add_option(name, *value, help);
  }
  CLI::Option& last_option(const char* what) {
    if (last == nullptr)
      throw std::logic_error(std::string("CommandLine::") + what + " before any option");
    return *last;
  }
};

CommandLine::CommandLine(const std::string& description)
    : impl_(std::make_unique<Impl>(description)) {}
CommandLine::~CommandLine() = default;

CommandLine& CommandLine::option(const std::string& name, int* value, const std::string& help) {
  impl_->add(name, value, help);
  return *this;
}
CommandLine& CommandLine::option(const std::string& name, int64_t* value, const std::string& help) {
  impl_->add(name, value, help);
  return *this;
}
CommandLine& CommandLine::option(const std::string& name, double* value, const std::string& help) {
  impl_->add(name, value, help);
  return *this;
}
CommandLine& CommandLine::option(const std::string& name, bool* value, const std::string& help) {
  impl_->add(name, value, help);
  return *this;
}
CommandLine& CommandLine::option(const std::string& name, std::string* value,
                                 const std::string& help) {
  impl_->add(name, value, help);
  return *this;
}
CommandLine& CommandLine::option(const std::string& name, std::vector<std::string>* value,
                                 const std::string& help) {
  impl_->add(name, value, help);
  impl_->last->delimiter(',');
  return *this;
}
CommandLine& CommandLine::flag(const std::string& name, bool* value, const std::string& help) {
  impl_->last = impl_->app.add_flag(name, *value, help);
  return *this;
}

CommandLine& CommandLine::one_of(const std::vector<std::string>& names) {
  impl_->last_option("one_of").check(CLI::IsMember(names));
  return *this;
}
CommandLine& CommandLine::positive() {
  impl_->last_option("positive").check(CLI::PositiveNumber);
  return *this;
}
CommandLine& CommandLine::non_negative() {
  impl_->last_option("non_negative").check(CLI::NonNegativeNumber);
  return *this;
}

void CommandLine::parse(int argc, char** argv) {
  try {
    impl_->app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::exit(impl_->app.exit(e));
  }
}

}  // namespace bench

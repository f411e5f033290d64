#include "program_check.h"

#include <sys/stat.h>
#include <unistd.h>

namespace fsdp::launch {
namespace {

/// What a shell exits with when it cannot find, or cannot execute, a program.
constexpr int kNotFound = 127;
constexpr int kNotExecutable = 126;

/// What is at `file`, as far as exec cares.
enum class Found { kNothing, kDirectory, kNotExecutable, kExecutable };

Found look_at(const std::string& file) {
  struct stat st {};
  if (::stat(file.c_str(), &st) != 0) return Found::kNothing;
  if (S_ISDIR(st.st_mode)) return Found::kDirectory;
  if (!S_ISREG(st.st_mode) || ::access(file.c_str(), X_OK) != 0) return Found::kNotExecutable;
  return Found::kExecutable;
}

bool ends_with_py(const std::string& name) {
  return name.size() > 3 && name.compare(name.size() - 3, 3, ".py") == 0;
}

/// The fix for a file that lacks the execute bit.
std::string chmod_hint(const std::string& file) {
  std::string hint = "chmod +x " + file;
  // Only --no-python runs a .py script itself.
  if (ends_with_py(file)) hint += ", or drop --no-python to run it as python3 -u " + file;
  return hint;
}

}  // namespace

std::optional<ProgramProblem> check_program(const LaunchOptions& options,
                                            const std::optional<std::string>& path) {
  const std::string& program = options.command[0];
  // The program may be the interpreter fsdprun put in front of a script.
  const bool python = !options.python_script.empty();
  const std::string head =
      "cannot execute '" + program + "'" +
      (python ? " to run " + options.python_script + " as torchrun does" : "") + ": ";
  const std::string python_fix =
      "; set PYTHON_EXEC to the Python to use, or give --no-python to run the script itself";
  const auto problem = [&](const std::string& what, int exit_code) {
    return ProgramProblem{head + what + (python ? python_fix : ""), exit_code};
  };
  if (program.find('/') != std::string::npos) {
    switch (look_at(program)) {
      case Found::kExecutable:
        return std::nullopt;
      case Found::kNothing:
        return problem("no such file", kNotFound);
      case Found::kDirectory:
        return problem("it is a directory", kNotExecutable);
      case Found::kNotExecutable:
        return problem("it lacks the execute permission; " + chmod_hint(program), kNotExecutable);
    }
  }
  std::string not_executable;  // the first match in PATH that exec would refuse
  const std::string dirs = path.value_or("/bin:/usr/bin");
  for (size_t start = 0; start <= dirs.size();) {
    size_t end = dirs.find(':', start);
    if (end == std::string::npos) end = dirs.size();
    // An empty entry is the current directory, as for execvp.
    const std::string dir = end == start ? "." : dirs.substr(start, end - start);
    const std::string file = dir + "/" + program;
    const Found found = look_at(file);
    if (found == Found::kExecutable) return std::nullopt;
    if (found == Found::kNotExecutable && not_executable.empty()) not_executable = file;
    start = end + 1;
  }
  if (!not_executable.empty()) {
    return problem(
        "PATH's " + not_executable + " lacks the execute permission; " + chmod_hint(not_executable),
        kNotExecutable);
  }
  if (!python && look_at(program) != Found::kNothing) {
    return problem("it is not in PATH; for the one in this directory, write ./" + program,
                   kNotFound);
  }
  return problem("not found in PATH", kNotFound);
}

}  // namespace fsdp::launch

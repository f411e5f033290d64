// In-process tests of what fsdprun takes over from torchrun 2.15's
// run.py and elastic agent: PET_ variables, its newer flags, the Python
// interpreter in front of a script, the workers' environment, and the
// check that the program can run at all.

#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "detail/posix_files.h"
#include "exit_status.h"
#include "line_prefixer.h"
#include "options.h"
#include "program_check.h"
#include "rank_env.h"

namespace fsdp::launch {
namespace {

using Args = std::vector<std::string>;

/// The value of `key` in a "KEY=VALUE" list, or "<unset>".
std::string env_value(const std::vector<std::string>& env, const std::string& key) {
  for (const std::string& entry : env) {
    if (entry.rfind(key + "=", 0) == 0) return entry.substr(key.size() + 1);
  }
  return "<unset>";
}

/// Whether some line of `lines` contains `text`.
bool mentions(const std::vector<std::string>& lines, const std::string& text) {
  return std::any_of(lines.begin(), lines.end(),
                     [&](const std::string& l) { return l.find(text) != std::string::npos; });
}

// torchrun's argparse_util.env: every flag's default from PET_<FLAG>
// (check_env: 1 or 0 for one without a value); the command line wins, and a
// bad value is an error naming the variable.
TEST(FsdprunTorchrunParity, PetVariablesAreTheFlagsDefaults) {
  const Args env = {"PET_NNODES=1", "PET_NPROC_PER_NODE=2", "PET_MAX_RESTARTS=3", "PET_RDZV_ID=job",
                    "PATH=/bin"};
  ParseResult r = parse_options({"p"}, env);
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
  EXPECT_EQ(r.options.nnodes, 1);
  EXPECT_EQ(r.options.nproc_per_node, 2);
  EXPECT_EQ(r.options.max_restarts, 3);
  EXPECT_EQ(r.options.rdzv_id, "job");

  r = parse_options({"--nproc-per-node", "gpu", "--max_restarts=0", "p"}, env);
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
  EXPECT_EQ(r.options.nproc_per_node_device, "gpu");
  EXPECT_EQ(r.options.max_restarts, 0);

  EXPECT_TRUE(parse_options({"p"}, {"PET_STANDALONE=1"}).options.standalone);
  EXPECT_FALSE(parse_options({"p"}, {"PET_STANDALONE=0"}).options.standalone);
  EXPECT_FALSE(parse_options({"p"}, {"PET_STANDALONE="}).options.standalone);  // empty: unset
  EXPECT_EQ(parse_options({"p"}, {"PET_REDIRECTS=3"}).options.redirects.of(0), 3);
  // Only torchrun's own flags, under their long names.
  EXPECT_DOUBLE_EQ(parse_options({"p"}, {"PET_KILL_TIMEOUT=1", "PET_R=3"}).options.kill_timeout_s,
                   30.0);

  const auto error_of = [](const Args& env_entries) {
    const ParseResult e = parse_options({"p"}, env_entries);
    EXPECT_EQ(e.kind, ParseResult::Kind::kError);
    return e.error;
  };
  EXPECT_EQ(error_of({"PET_NPROC_PER_NODE=x"}),
            "PET_NPROC_PER_NODE: invalid value 'x' (must be >= 1, gpu, cpu or auto)");
  EXPECT_EQ(error_of({"PET_STANDALONE=yes"}),
            "PET_STANDALONE: invalid value 'yes' (1 stands for --standalone, 0 for its absence)");
  EXPECT_NE(error_of({"PET_NNODES=2", "PET_NODE_RANK=2"}).find("PET_NODE_RANK: invalid value '2'"),
            std::string::npos);
  EXPECT_NE(error_of({"PET_MODULE=1", "PET_NO_PYTHON=1"}).find("PET_MODULE runs a module"),
            std::string::npos);
}

// torchrun's shutdown timeout: --shutdown-timeout (fsdprun's --kill-timeout),
// else PET_SHUTDOWN_TIMEOUT, else TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30.
TEST(FsdprunTorchrunParity, ShutdownTimeout) {
  EXPECT_DOUBLE_EQ(parse_options({"--shutdown-timeout", "4", "p"}).options.kill_timeout_s, 4.0);
  EXPECT_DOUBLE_EQ(parse_options({"--shutdown_timeout=0", "p"}).options.kill_timeout_s, 0.0);
  const Args env = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT=5"};
  EXPECT_DOUBLE_EQ(parse_options({"p"}, env).options.kill_timeout_s, 5.0);
  EXPECT_DOUBLE_EQ(
      parse_options({"p"}, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT=5", "PET_SHUTDOWN_TIMEOUT=6"})
          .options.kill_timeout_s,
      6.0);
  EXPECT_DOUBLE_EQ(parse_options({"--kill-timeout", "2", "p"}, env).options.kill_timeout_s, 2.0);
  const ParseResult bad = parse_options({"p"}, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT=soon"});
  EXPECT_EQ(bad.kind, ParseResult::Kind::kError);
  EXPECT_NE(bad.error.find("TORCH_ELASTIC_SHUTDOWN_TIMEOUT: invalid value 'soon'"),
            std::string::npos);
  EXPECT_EQ(parse_options({"--shutdown-timeout", "-1", "p"}).kind, ParseResult::Kind::kError);
}

TEST(FsdprunTorchrunParity, SignalsToHandle) {
  ParseResult r = parse_options({"--signals-to-handle", "SIGUSR1, SIGTERM,SIGUSR1", "p"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
  EXPECT_EQ(r.options.signals_to_handle, (std::vector<int>{SIGUSR1, SIGTERM}));
  r = parse_options({"p"}, {"PET_SIGNALS_TO_HANDLE=SIGINT"});
  EXPECT_EQ(r.options.signals_to_handle, std::vector<int>{SIGINT});
  for (const char* bad : {"SIGKILL", "SIGSEGV", "SIGCHLD", "TERM", "15", ","}) {
    r = parse_options({"--signals-to-handle", bad, "p"});
    EXPECT_EQ(r.kind, ParseResult::Kind::kError) << bad;
    EXPECT_NE(r.error.find("SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1"), std::string::npos)
        << r.error;
  }
  EXPECT_EQ(signal_number("SIGQUIT"), SIGQUIT);
  EXPECT_EQ(signal_number("QUIT"), 0);
}

// torchrun 2.15's flags fsdprun has nothing to do with: accepted (with the
// arity torchrun gives them), each with one line saying it has no effect.
TEST(FsdprunTorchrunParity, FlagsWithoutEffectWarn) {
  const std::vector<Args> cases = {
      {"--event-log-handler", "null"},     {"--logs-specs", "x"},
      {"--numa-binding", "node"},          {"--virtual-local-rank"},
      {"--duplicate-stdout-filters", "a"}, {"--duplicate_stderr_filters=a,,b"},
  };
  for (const Args& flag : cases) {
    Args args = flag;
    args.push_back("p");
    const ParseResult r = parse_options(args);
    ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << flag[0] << ": " << r.error;
    EXPECT_EQ(r.options.command, Args{"p"});
    ASSERT_EQ(r.warnings.size(), 1u) << flag[0];
    const std::string name = flag[0].substr(0, flag[0].find('='));
    EXPECT_EQ(r.warnings[0].rfind(name + " has no effect under fsdprun: ", 0), 0u) << r.warnings[0];
  }
  EXPECT_EQ(parse_options({"--virtual-local-rank=1", "p"}).kind, ParseResult::Kind::kError);
}

// argparse's attached short values: -r3, -t0:3,1:2, -r=3.
TEST(FsdprunTorchrunParity, AttachedShortValues) {
  ParseResult r = parse_options({"-r3", "-t0:1,1:2", "p"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
  EXPECT_EQ(r.options.redirects.of(4), 3);
  EXPECT_EQ(r.options.tee.of(1), 2);
  EXPECT_EQ(parse_options({"-r=2", "p"}).options.redirects.of(0), 2);
  r = parse_options({"-r9", "p"});
  EXPECT_EQ(r.kind, ParseResult::Kind::kError);
  EXPECT_NE(r.error.find("-r: invalid value '9'"), std::string::npos) << r.error;
  EXPECT_EQ(parse_options({"-hx", "p"}).kind, ParseResult::Kind::kError);
}

// torchrun ignores --master-addr and --master-port where the endpoint says
// where to meet; fsdprun says so in one line.
TEST(FsdprunTorchrunParity, EndpointOverridesMasterAddrAndPortWithAWarning) {
  const ParseResult r = parse_options({"--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint",
                                       "10.0.0.1:1234", "--master-port", "2", "p"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
  EXPECT_EQ(r.options.master_addr, "10.0.0.1");
  EXPECT_EQ(r.options.master_port, 1234);
  EXPECT_EQ(r.warnings,
            Args{"--master-port: ignored, the nodes meet at --rdzv-endpoint 10.0.0.1:1234 (as "
                 "torchrun)"});
}

// --local-addr: node 0's MASTER_ADDR at the c10d rendezvous of several
// nodes; elsewhere accepted with a line saying it changes nothing.
TEST(FsdprunTorchrunParity, LocalAddr) {
  ParseResult r = parse_options({"--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                 "h:5", "--local-addr", "10.0.0.7", "p"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
  EXPECT_EQ(r.options.local_addr, "10.0.0.7");
  EXPECT_TRUE(r.warnings.empty());
  r = parse_options({"--local-addr", "10.0.0.7", "p"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
  EXPECT_TRUE(mentions(r.warnings, "--local-addr has no effect here")) << r.warnings.size();
  EXPECT_EQ(parse_options({"--local-addr", "a b", "p"}).kind, ParseResult::Kind::kError);
}

// torchrun runs its script as `python -u SCRIPT` unless --no-python; fsdprun
// does so for a script ending in .py (PYTHON_EXEC, as torchrun, else
// python3), for -m MODULE and --run-path; other programs run themselves.
TEST(FsdprunTorchrunParity, PythonInFrontOfScriptsAndModules) {
  ParseResult r = parse_options({"--nproc-per-node", "2", "train.py", "--lr", "3"});
  ASSERT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
  EXPECT_EQ(r.options.command, (Args{"python3", "-u", "train.py", "--lr", "3"}));
  EXPECT_EQ(r.options.python_script, "train.py");
  EXPECT_EQ(parse_options({"t.py"}, {"PYTHON_EXEC=/venv/bin/python"}).options.command,
            (Args{"/venv/bin/python", "-u", "t.py"}));
  EXPECT_EQ(parse_options({"--no-python", "t.py"}).options.command, Args{"t.py"});
  EXPECT_EQ(parse_options({"./train", "x.py"}).options.command, (Args{"./train", "x.py"}));
  EXPECT_EQ(parse_options({"-m", "pkg.train", "--lr"}).options.command,
            (Args{"python3", "-u", "-m", "pkg.train", "--lr"}));
  EXPECT_EQ(parse_options({"--module", "pkg"}).options.python_script, "pkg");
  EXPECT_EQ(parse_options({"--run-path", "--no-python", "-m", "/abs/train"}).options.command,
            (Args{"python3", "-u", "/abs/train"}));
  r = parse_options({"--no-python", "-m", "pkg"});
  EXPECT_EQ(r.kind, ParseResult::Kind::kError);
  EXPECT_EQ(r.error,
            "-m runs a module through Python, which --no-python forbids: give one of them");
}

// The variables torchrun's agent sets besides fsdprun's first ones.
TEST(FsdprunTorchrunParity, WorkerEnvironment) {
  LaunchOptions options;
  options.nnodes = 3;
  options.node_rank = 2;
  auto env = build_rank_environment(options, 1, 0, 0, {"TORCHELASTIC_USE_AGENT_STORE=True"});
  EXPECT_EQ(env_value(env, "GROUP_WORLD_SIZE"), "3");
  EXPECT_EQ(env_value(env, "TORCHELASTIC_USE_AGENT_STORE"), "False");
  EXPECT_EQ(env_value(env, "TORCH_NCCL_ASYNC_ERROR_HANDLING"), "1");
  env = build_rank_environment(options, 1, 0, 0, {"TORCH_NCCL_ASYNC_ERROR_HANDLING=0"});
  EXPECT_EQ(env_value(env, "TORCH_NCCL_ASYNC_ERROR_HANDLING"), "0");
}

// Python's string.Template.safe_substitute, as torchrun fills its template.
TEST(FsdprunTorchrunParity, LogLinePrefixTemplate) {
  const std::map<std::string, std::string> values = {
      {"rank", "5"}, {"local_rank", "1"}, {"role_name", "default"}, {"hostname", "n1"}};
  EXPECT_EQ(expand_prefix_template("[${role_name}${local_rank}]:", values), "[default1]:");
  EXPECT_EQ(expand_prefix_template("$hostname:$rank $$x ${rank", values), "n1:5 $x ${rank");
  EXPECT_EQ(expand_prefix_template("$nope ${nope} $ $1 end$", values), "$nope ${nope} $ $1 end$");
  EXPECT_EQ(expand_prefix_template("$ranks", values), "$ranks");
  EXPECT_EQ(parse_options({"--log-line-prefix-template", "${rank}| ", "p"})
                .options.log_line_prefix_template,
            "${rank}| ");
  EXPECT_EQ(parse_options({"p"}, {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE=x"})
                .options.log_line_prefix_template,
            "x");
}

/// A scratch directory, removed at the end; the test's working directory
/// while it lives (a program named without '/' is looked for there too).
class ScratchDir {
 public:
  ScratchDir() {
    char name[] = "/tmp/fsdprun_parity_XXXXXX";
    const char* made = ::mkdtemp(name);
    EXPECT_NE(made, nullptr);
    path_ = made != nullptr ? made : "/nonexistent";
    EXPECT_NE(::getcwd(old_cwd_, sizeof(old_cwd_)), nullptr);
    EXPECT_EQ(::chdir(path_.c_str()), 0);
  }
  ~ScratchDir() {
    EXPECT_EQ(::chdir(old_cwd_), 0);
    std::error_code ignored;
    fsdp::detail::remove_tree(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::string& path() const { return path_; }
  /// Creates `name` in the directory with permissions `mode`.
  void file(const std::string& name, mode_t mode) const {
    std::ofstream(path_ + "/" + name) << "#!/bin/sh\n";
    ::chmod((path_ + "/" + name).c_str(), mode);
  }

 private:
  std::string path_;
  char old_cwd_[4096] = {};
};

/// check_program's message for `command` under `path`, or "ok".
std::string problem_of(const Args& command, const std::optional<std::string>& path,
                       int* exit_code = nullptr) {
  const ParseResult r = parse_options(command);
  EXPECT_EQ(r.kind, ParseResult::Kind::kRun) << r.error;
  const auto problem = check_program(r.options, path);
  if (exit_code != nullptr) *exit_code = problem ? problem->exit_code : 0;
  return problem ? problem->message : "ok";
}

// Each way a program cannot start is one line with the fix, where exec's
// errno would say "No such file or directory" or "Permission denied".
TEST(FsdprunTorchrunParity, ProgramCheckNamesTheFix) {
  ScratchDir dir;
  dir.file("run", 0755);
  dir.file("plain", 0644);
  dir.file("tool.py", 0644);
  ::mkdir((dir.path() + "/bin").c_str(), 0755);
  dir.file("bin/tool", 0644);
  const std::string bin = dir.path() + "/bin";
  int code = 0;
  EXPECT_EQ(problem_of({"./run"}, "/nonexistent"), "ok");
  EXPECT_EQ(problem_of({"run"}, "/nonexistent:"), "ok");  // an empty entry: the cwd
  EXPECT_EQ(problem_of({"sh"}, std::nullopt), "ok");      // glibc's /bin:/usr/bin
  EXPECT_EQ(problem_of({"run"}, "/nonexistent", &code),
            "cannot execute 'run': it is not in PATH; for the one in this directory, write ./run");
  EXPECT_EQ(code, 127);
  EXPECT_EQ(problem_of({"./plain"}, "/nonexistent", &code),
            "cannot execute './plain': it lacks the execute permission; chmod +x ./plain");
  EXPECT_EQ(code, 126);
  EXPECT_EQ(problem_of({"--no-python", "./tool.py"}, "/nonexistent"),
            "cannot execute './tool.py': it lacks the execute permission; chmod +x ./tool.py, or "
            "drop --no-python to run it as python3 -u ./tool.py");
  EXPECT_EQ(problem_of({"tool"}, bin, &code), "cannot execute 'tool': PATH's " + bin +
                                                  "/tool lacks the execute permission; "
                                                  "chmod +x " +
                                                  bin + "/tool");
  EXPECT_EQ(code, 126);
  EXPECT_EQ(problem_of({"./missing"}, "/nonexistent", &code),
            "cannot execute './missing': no such file");
  EXPECT_EQ(code, 127);
  EXPECT_EQ(problem_of({"./bin"}, "/nonexistent"), "cannot execute './bin': it is a directory");
  EXPECT_EQ(problem_of({"missing"}, bin), "cannot execute 'missing': not found in PATH");
  EXPECT_EQ(problem_of({"tool.py"}, "/nonexistent", &code),
            "cannot execute 'python3' to run tool.py as torchrun does: not found in PATH; set "
            "PYTHON_EXEC to the Python to use, or give --no-python to run the script itself");
  EXPECT_EQ(code, 127);
}

}  // namespace
}  // namespace fsdp::launch

#include "rendezvous/launch_env.h"

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <limits>

#include "detail/error.h"

namespace fsdp::detail {

// Note [Launch environments]
// Clusters start ranks three ways, and init_process_group() reads all three:
// a launcher per node (fsdprun, `torchrun --no-python`) sets RANK,
// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE; Open MPI's mpirun sets
// OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}; SLURM's srun sets
// SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID and the tasks per
// node. They nest, so one process often sees two sets that legitimately
// differ: srun (or mpirun) starting one torchrun per node leaves the
// scheduler's variables in the ranks, describing the torchrun process
// (SLURM_PROCID is then the node's index); mpirun inside a SLURM allocation
// starts its daemons with srun, so its ranks carry a daemon's SLURM_PROCID.
// The innermost launcher started this process, so it wins: torchrun's set,
// then mpirun's, then srun's. torchrun's set is told apart from RANK and
// WORLD_SIZE exported by hand by what every torchrun-style launcher also sets
// (TORCHELASTIC_RESTART_COUNT, GROUP_RANK or LOCAL_WORLD_SIZE). Variables set
// by hand under mpirun or srun must agree with it: a stale `export
// WORLD_SIZE=4` under `mpirun -np 2` would make both ranks wait for four until
// the timeout, so a disagreement is an error on every rank naming both.
//
// srun counts only inside a job step (SLURM_STEP_ID set): a batch script or an
// salloc shell also has SLURM_PROCID=0 and the allocation's SLURM_NTASKS, and
// a program run there directly is one process, not rank 0 of many. Its ranks
// per node come from the step's SLURM_STEP_TASKS_PER_NODE ("4(x2),3": exact
// for this step), else SLURM_NTASKS_PER_NODE, else the job's
// SLURM_TASKS_PER_NODE (which may describe the allocation rather than the
// step), taken at SLURM_NODEID.
//
// The store's address: MASTER_ADDR and MASTER_PORT when set (torchrun and
// fsdprun always set them). Under srun, else the first host of the step's node
// list (rank 0 runs on node 0) and port 20000 + (10 * SLURM_JOB_ID +
// SLURM_STEP_ID) mod 10000: the same on every rank, below Linux's ephemeral
// ports, and different for the steps of one job and for most jobs sharing a
// node. mpirun says nothing about hosts: on one node 127.0.0.1, across nodes
// the user passes `-x MASTER_ADDR=...`. Any launch whose ranks span nodes
// (local world size below the world size) with no address is an error saying
// so, not 127.0.0.1 and a hang. Else 127.0.0.1 and 29500, as before.
//
// The node layout (RankInfo::node_rank, num_nodes), which HYBRID_SHARD's node
// groups follow, comes from the launcher where it says (GROUP_RANK,
// GROUP_WORLD_SIZE, SLURM_NODEID, the step's node count), else from ranks
// being numbered node by node, which is every launcher's default (mpirun's
// `--map-by slot`; `--map-by node` breaks it).
//
// An option set explicitly wins over all of this, field by field and without
// checks against the environment: a program that computes its own layout knows
// better than a stale variable. A world size from an option that differs from
// the launcher's also drops the launcher's local and node layout, which
// described the launcher's world.

namespace {

constexpr const char* kWhere = "init_process_group";

/// One field of a layout: its value, if the source gives one, and the name it
/// goes by there (a variable, or an option), for messages.
struct Field {
  std::optional<int64_t> value;
  std::string name;

  bool has_value() const { return value.has_value(); }
  /// "NAME=value"; only for a field with a value.
  std::string show() const { return name + "=" + std::to_string(*value); }
};

/// What one source says about where this process sits.
struct Layout {
  /// RankInfo::launcher's name for the source.
  std::string launcher;
  Field rank, world_size, local_rank, local_world_size, node_rank, num_nodes;

  bool present() const {
    return rank.has_value() || world_size.has_value() || local_rank.has_value() ||
           local_world_size.has_value();
  }
};

/// A variable as a non-negative int, or nullopt when unset.
std::optional<int64_t> read_int(const EnvLookup& env, const std::string& name) {
  const std::optional<std::string> text = env(name);
  if (!text) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text->c_str(), &end, 10);
  FSDP_CHECK(errno == 0 && end != text->c_str() && *end == '\0' && v >= 0 &&
                 v <= std::numeric_limits<int>::max(),
             -1, kWhere, name, "='", *text,
             "' is not a non-negative integer. Unset it or fix the launcher.");
  return v;
}

Field int_field(const EnvLookup& env, const std::string& name) {
  return Field{read_int(env, name), name};
}

/// The first of `names` that is set (named as the first when none is).
Field first_int_field(const EnvLookup& env, const std::vector<std::string>& names) {
  for (const std::string& name : names) {
    if (env(name)) return int_field(env, name);
  }
  return Field{std::nullopt, names.front()};
}

Layout torchrun_layout(const EnvLookup& env) {
  return Layout{"torchrun",
                int_field(env, "RANK"),
                int_field(env, "WORLD_SIZE"),
                int_field(env, "LOCAL_RANK"),
                int_field(env, "LOCAL_WORLD_SIZE"),
                int_field(env, "GROUP_RANK"),
                int_field(env, "GROUP_WORLD_SIZE")};
}

/// Whether a torchrun-style launcher, not a user, set RANK and WORLD_SIZE.
bool set_by_torchrun(const EnvLookup& env) {
  return env("TORCHELASTIC_RESTART_COUNT") || env("GROUP_RANK") || env("LOCAL_WORLD_SIZE");
}

Layout mpirun_layout(const EnvLookup& env) {
  return Layout{"mpirun",
                int_field(env, "OMPI_COMM_WORLD_RANK"),
                int_field(env, "OMPI_COMM_WORLD_SIZE"),
                int_field(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
                int_field(env, "OMPI_COMM_WORLD_LOCAL_SIZE"),
                Field{std::nullopt, "node index"},
                Field{std::nullopt, "number of nodes"}};
}

/// The id of the srun job step this process runs in, or nullopt outside one.
/// SLURM's special steps (batch script, extern, salloc's interactive step:
/// ids from 0xfffffff0 up) start no ranks, so they do not count.
std::optional<int64_t> srun_step(const EnvLookup& env) {
  for (const char* name : {"SLURM_STEP_ID", "SLURM_STEPID"}) {
    const std::optional<std::string> text = env(name);
    if (!text) continue;
    char* end = nullptr;
    errno = 0;
    const unsigned long long v = std::strtoull(text->c_str(), &end, 10);
    FSDP_CHECK(errno == 0 && end != text->c_str() && *end == '\0' && (*text)[0] != '-', -1, kWhere,
               name, "='", *text, "' is not a step id. Unset it or fix the launcher.");
    constexpr unsigned long long kFirstSpecialStep = 0xfffffff0ULL;
    if (v >= kFirstSpecialStep) return std::nullopt;
    return static_cast<int64_t>(v);
  }
  return std::nullopt;
}

/// SLURM's ranks on this node; see Note [Launch environments].
Field slurm_local_world_size(const EnvLookup& env, Layout& layout) {
  for (const char* name :
       {"SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
    const std::optional<std::string> text = env(name);
    if (!text) continue;
    const std::vector<int64_t> counts = slurm_tasks_per_node(*text, name);
    if (counts.size() == 1 && std::string(name) == "SLURM_NTASKS_PER_NODE") {
      return Field{counts[0], name};  // the same on every node
    }
    if (!layout.num_nodes.has_value()) {
      layout.num_nodes = Field{static_cast<int64_t>(counts.size()), name};
    }
    FSDP_CHECK(layout.node_rank.has_value(), -1, kWhere, name, "='", *text,
               "' lists the tasks of each node but SLURM_NODEID is unset. Start the ranks "
               "with srun, or set MASTER_ADDR, RANK, WORLD_SIZE, LOCAL_RANK and "
               "LOCAL_WORLD_SIZE yourself.");
    const int64_t node = *layout.node_rank.value;
    FSDP_CHECK(node < static_cast<int64_t>(counts.size()), -1, kWhere, "SLURM_NODEID=", node,
               " but ", name, "='", *text, "' lists ", counts.size(),
               " nodes. Start the ranks with srun, or unset the stale variable.");
    return Field{counts[node], name};
  }
  return Field{std::nullopt, "SLURM_STEP_TASKS_PER_NODE"};
}

Layout srun_layout(const EnvLookup& env) {
  Layout layout{"srun",
                int_field(env, "SLURM_PROCID"),
                first_int_field(env, {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"}),
                int_field(env, "SLURM_LOCALID"),
                Field{std::nullopt, "SLURM_STEP_TASKS_PER_NODE"},
                int_field(env, "SLURM_NODEID"),
                first_int_field(env, {"SLURM_STEP_NUM_NODES", "SLURM_NNODES"})};
  layout.local_world_size = slurm_local_world_size(env, layout);
  return layout;
}

/// Fails when a variable set by hand disagrees with the launcher's. Fields
/// an option sets are not compared: the option wins.
void check_hand_set_agrees(const Layout& by_hand, const Layout& launched,
                           const ProcessGroupOptions& options) {
  const std::pair<const Field*, const Field*> pairs[] = {
      {&by_hand.rank, &launched.rank},
      {&by_hand.world_size, &launched.world_size},
      {&by_hand.local_rank, &launched.local_rank},
      {&by_hand.local_world_size, &launched.local_world_size}};
  const int64_t set_by_option[] = {options.rank(), options.world_size(), options.local_rank(),
                                   options.local_world_size()};
  const int rank = launched.rank.has_value() ? static_cast<int>(*launched.rank.value) : -1;
  for (size_t i = 0; i < 4; ++i) {
    const Field& hand = *pairs[i].first;
    const Field& ours = *pairs[i].second;
    if (set_by_option[i] >= 0 || !hand.has_value() || !ours.has_value()) continue;
    FSDP_CHECK(*hand.value == *ours.value, rank, kWhere, hand.show(), " but ", ours.show(), ": ",
               launched.launcher, " started this process, and ", hand.name,
               " was set by hand (no launcher marks it as its own). Unset ", hand.name,
               " (a stale export?) or make it agree with ", launched.launcher, ".");
  }
}

/// The launcher's layout (see Note [Launch environments]), before options.
Layout launcher_layout(const EnvLookup& env, const ProcessGroupOptions& options) {
  Layout by_hand = torchrun_layout(env);
  if (by_hand.present() && set_by_torchrun(env)) return by_hand;
  std::optional<Layout> launched;
  if (Layout mpi = mpirun_layout(env); mpi.present()) {
    launched = mpi;
  } else if (srun_step(env)) {
    launched = srun_layout(env);
  }
  if (launched) {
    check_hand_set_agrees(by_hand, *launched, options);
    return *launched;
  }
  by_hand.launcher = by_hand.present() ? "environment" : "none";
  return by_hand;
}

/// The option when set (>= 0), else the launcher's field.
Field pick(int64_t option, const char* option_name, const Field& from_launcher) {
  if (option >= 0) return Field{option, std::string("ProcessGroupOptions::") + option_name};
  return from_launcher;
}

int to_int(int64_t v) { return static_cast<int>(v); }

/// Rank 0's host and port for `layout`; see Note [Launch environments].
void resolve_master(const ProcessGroupOptions& options, const EnvLookup& env, const Layout& layout,
                    LaunchEnv& out) {
  const RankInfo& info = out.info;
  std::optional<std::string> addr;
  if (!options.master_addr().empty()) addr = options.master_addr();
  if (!addr) addr = env("MASTER_ADDR");
  std::optional<int64_t> port;
  if (options.master_port() >= 0) port = options.master_port();
  if (!port) port = read_int(env, "MASTER_PORT");
  if (layout.launcher == "srun") {
    for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
      if (addr) break;
      if (const std::optional<std::string> list = env(name)) addr = first_slurm_host(*list, name);
    }
    const std::optional<int64_t> job = first_int_field(env, {"SLURM_JOB_ID", "SLURM_JOBID"}).value;
    if (!port && job) port = 20000 + (10 * *job + srun_step(env).value_or(0)) % 10000;
  }
  if (!addr && info.local_world_size < info.world_size) {
    const std::string fix = layout.launcher == "mpirun"
                                ? "Pass `-x MASTER_ADDR=<node 0's address>` to mpirun."
                                : "Set MASTER_ADDR to the address of rank 0's node.";
    FSDP_FAIL(info.rank, kWhere, "the ", info.world_size, " ranks run on ", info.num_nodes,
              " nodes (", info.local_world_size,
              " on this one) and MASTER_ADDR is unset, so they cannot tell where rank 0 is. ", fix);
  }
  out.master_addr = addr.value_or("127.0.0.1");
  out.master_port = port.value_or(29500);
  FSDP_CHECK(out.master_port > 0 && out.master_port <= 65535, info.rank, kWhere, "master port ",
             out.master_port, " is not in [1, 65535]");
}

}  // namespace

EnvLookup process_environment() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* text = std::getenv(name.c_str());
    if (text == nullptr || *text == '\0') return std::nullopt;
    return std::string(text);
  };
}

LaunchEnv resolve_launch_env(const ProcessGroupOptions& options, const EnvLookup& env) {
  const Layout launched = launcher_layout(env, options);
  const Field rank = pick(options.rank(), "rank", launched.rank);
  const Field world = pick(options.world_size(), "world_size", launched.world_size);
  // The launcher's node layout describes the launcher's world; an option
  // giving another world size leaves it behind.
  const bool same_world =
      !launched.world_size.has_value() || *launched.world_size.value == world.value.value_or(1);
  const Field local_rank =
      pick(options.local_rank(), "local_rank",
           same_world ? launched.local_rank : Field{std::nullopt, launched.local_rank.name});
  const Field local_world = pick(
      options.local_world_size(), "local_world_size",
      same_world ? launched.local_world_size : Field{std::nullopt, launched.local_world_size.name});
  const int rank_or_unknown = rank.has_value() ? to_int(*rank.value) : -1;

  // A rank without a world size (or the reverse) is a half-configured launch;
  // only the single-rank readings (rank 0, world size 1) make sense alone.
  FSDP_CHECK(!rank.has_value() || world.has_value() || *rank.value == 0, rank_or_unknown, kWhere,
             rank.show(), " is set but ", world.name,
             " is not. Set both, or neither for a single rank.");
  FSDP_CHECK(!world.has_value() || rank.has_value() || *world.value == 1, -1, kWhere, world.show(),
             " is set but ", rank.name, " is not. Set both, or neither for a single rank.");
  FSDP_CHECK(!local_world.has_value() || local_rank.has_value(), rank_or_unknown, kWhere,
             local_world.show(), " is set but ", local_rank.name, " is not. Set both, or neither.");

  LaunchEnv out;
  RankInfo& info = out.info;
  info.rank = to_int(rank.value.value_or(0));
  info.world_size = to_int(world.value.value_or(1));
  info.local_rank = to_int(local_rank.value.value_or(info.rank));
  info.local_world_size = to_int(local_world.value.value_or(info.world_size));
  const bool from_options = options.rank() >= 0 && options.world_size() >= 0;
  info.launcher = from_options ? "options" : launched.launcher;

  FSDP_CHECK(info.world_size >= 1, -1, kWhere, "world size must be >= 1, got ", world.show());
  FSDP_CHECK(info.rank < info.world_size, -1, kWhere, "rank ", info.rank,
             " is not below the world size ", info.world_size, " (", rank.name, ", ", world.name,
             " from ", info.launcher, "). Fix the launch, or start the job with fsdprun.");
  FSDP_CHECK(info.local_world_size >= 1 && info.local_world_size <= info.world_size, info.rank,
             kWhere, "local world size ", info.local_world_size, " (", local_world.name,
             ") is not in [1, world size ", info.world_size, "]. Fix the launch.");
  FSDP_CHECK(info.local_rank < info.local_world_size, info.rank, kWhere, "local rank ",
             info.local_rank, " is not below the local world size ", info.local_world_size, " (",
             local_rank.name, ", ", local_world.name, "). Fix the launch.");

  // The launcher's node layout holds only for the launcher's own sizes.
  const bool sizes_from_launcher = same_world && options.rank() < 0 && options.world_size() < 0 &&
                                   options.local_rank() < 0 && options.local_world_size() < 0;
  const int derived_nodes = (info.world_size + info.local_world_size - 1) / info.local_world_size;
  info.node_rank = sizes_from_launcher && launched.node_rank.has_value()
                       ? to_int(*launched.node_rank.value)
                       : info.rank / info.local_world_size;
  info.num_nodes = sizes_from_launcher && launched.num_nodes.has_value()
                       ? to_int(*launched.num_nodes.value)
                       : derived_nodes;
  FSDP_CHECK(info.node_rank < info.num_nodes, info.rank, kWhere, "node ", info.node_rank,
             " is not below the number of nodes ", info.num_nodes, " (", launched.node_rank.name,
             ", ", launched.num_nodes.name, " from ", info.launcher, "). Fix the launch.");

  resolve_master(options, env, launched, out);
  // Only torchrun's own address leads to its agent's store.
  const std::optional<std::string> agent_store = env("TORCHELASTIC_USE_AGENT_STORE");
  if (launched.launcher == "torchrun" && agent_store && *agent_store == "True" &&
      options.master_addr().empty() && options.master_port() < 0) {
    out.agent_store_attempt = read_int(env, "TORCHELASTIC_RESTART_COUNT").value_or(0);
  }
  return out;
}

std::string first_slurm_host(const std::string& nodelist, const std::string& variable) {
  auto bad = [&](const char* why) {
    FSDP_FAIL(-1, kWhere, variable, "='", nodelist, "' is not a SLURM node list (", why,
              "). Set MASTER_ADDR to rank 0's host.");
  };
  std::string host;
  size_t i = 0;
  while (i < nodelist.size() && nodelist[i] != ',') {
    if (nodelist[i] != '[') {
      host += nodelist[i++];
      continue;
    }
    // "[01-04,07]": the first host takes the first number of the range.
    const size_t close = nodelist.find(']', i);
    if (close == std::string::npos) bad("unclosed '['");
    const std::string inside = nodelist.substr(i + 1, close - i - 1);
    const std::string first = inside.substr(0, inside.find_first_of(",-"));
    if (first.empty()) bad("empty range");
    for (const char c : first) {
      if (std::isdigit(static_cast<unsigned char>(c)) == 0) bad("a range that is not numbers");
    }
    host += first;
    i = close + 1;
  }
  if (host.empty()) bad("no host");
  return host;
}

std::vector<int64_t> slurm_tasks_per_node(const std::string& text, const std::string& variable) {
  auto bad = [&] {
    FSDP_FAIL(-1, kWhere, variable, "='", text,
              "' is not SLURM's tasks-per-node form (such as \"4(x2),3\"). Unset it or fix the "
              "job script.");
  };
  // Reads digits at `i` (at most 9, so no overflow); fails when there are none.
  auto number = [&](size_t& i) {
    const size_t start = i;
    while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i])) != 0) ++i;
    if (i == start || i - start > 9) bad();
    return static_cast<int64_t>(std::stoll(text.substr(start, i - start)));
  };
  constexpr int64_t kMaxNodes = 1 << 20;
  std::vector<int64_t> counts;
  size_t i = 0;
  while (true) {
    const int64_t tasks = number(i);
    int64_t repeat = 1;
    if (i < text.size() && text[i] == '(') {
      if (text.compare(i, 2, "(x") != 0) bad();
      i += 2;
      repeat = number(i);
      if (i >= text.size() || text[i] != ')') bad();
      ++i;
    }
    if (repeat < 1 || static_cast<int64_t>(counts.size()) + repeat > kMaxNodes) bad();
    counts.insert(counts.end(), static_cast<size_t>(repeat), tasks);
    if (i == text.size()) break;
    if (text[i] != ',') bad();
    ++i;
  }
  return counts;
}

}  // namespace fsdp::detail

#pragma once

// The table of fsdprun's flags: their names, arity and PET_ fallback.

#include <string>

namespace fsdp::launch::detail {

/// The flags fsdprun understands, in their canonical '-' spelling.
enum class Flag {
  kNprocPerNode,
  kNnodes,
  kNodeRank,
  kMasterAddr,
  kMasterPort,
  kLocalAddr,
  kStandalone,
  kMaxRestarts,
  kKillTimeout,
  kSignalsToHandle,
  kNoPrefix,
  kLogLinePrefixTemplate,
  kRdzvBackend,
  kRdzvEndpoint,
  kRdzvId,
  kRdzvConf,
  kNoPython,
  kLocalRanksFilter,
  kLogDir,
  kRedirects,
  kTee,
  kMonitorInterval,
  kStartMethod,
  kRole,
  kModule,
  kRunPath,
  kNoEffect,
  kHelp,
};

/// One row of the flag table.
struct FlagSpec {
  const char* name;
  Flag flag;
  bool takes_value;
  /// Whether torchrun reads its default from PET_<NAME> (argparse_util's
  /// env and check_env); set on one spelling of each flag.
  bool from_env;
  /// For kNoEffect: why fsdprun has nothing to do with it.
  const char* why = nullptr;
};

/// Every spelling of every flag; the PET_ fallback takes them in this order.
inline constexpr FlagSpec kFlags[] = {
    {"--nproc-per-node", Flag::kNprocPerNode, true, true},
    {"--nnodes", Flag::kNnodes, true, true},
    {"--node-rank", Flag::kNodeRank, true, true},
    {"--master-addr", Flag::kMasterAddr, true, true},
    {"--master-port", Flag::kMasterPort, true, true},
    {"--local-addr", Flag::kLocalAddr, true, true},
    {"--standalone", Flag::kStandalone, false, true},
    {"--max-restarts", Flag::kMaxRestarts, true, true},
    {"--shutdown-timeout", Flag::kKillTimeout, true, true},
    {"--kill-timeout", Flag::kKillTimeout, true, false},
    {"--signals-to-handle", Flag::kSignalsToHandle, true, true},
    {"--no-prefix", Flag::kNoPrefix, false, false},
    {"--log-line-prefix-template", Flag::kLogLinePrefixTemplate, true, true},
    {"--rdzv-backend", Flag::kRdzvBackend, true, true},
    {"--rdzv-endpoint", Flag::kRdzvEndpoint, true, true},
    {"--rdzv-id", Flag::kRdzvId, true, true},
    {"--rdzv-conf", Flag::kRdzvConf, true, true},
    {"--no-python", Flag::kNoPython, false, true},
    {"--local-ranks-filter", Flag::kLocalRanksFilter, true, true},
    {"--log-dir", Flag::kLogDir, true, true},
    {"--redirects", Flag::kRedirects, true, true},
    {"-r", Flag::kRedirects, true, false},
    {"--tee", Flag::kTee, true, true},
    {"-t", Flag::kTee, true, false},
    {"--monitor-interval", Flag::kMonitorInterval, true, true},
    {"--start-method", Flag::kStartMethod, true, true},
    {"--role", Flag::kRole, true, true},
    {"--module", Flag::kModule, false, true},
    {"-m", Flag::kModule, false, false},
    {"--run-path", Flag::kRunPath, false, true},
    {"--event-log-handler", Flag::kNoEffect, true, true, "fsdprun logs no torchelastic events"},
    {"--logs-specs", Flag::kNoEffect, true, false,
     "it names a Python plugin; use --log-dir, --redirects and --tee"},
    {"--numa-binding", Flag::kNoEffect, true, false,
     "fsdprun binds no rank to CPUs; start the program under numactl for that"},
    {"--virtual-local-rank", Flag::kNoEffect, false, true,
     "LOCAL_RANK stays the local rank and every rank sees every GPU"},
    {"--duplicate-stdout-filters", Flag::kNoEffect, true, true,
     "no line is copied to a file of its own; use --tee"},
    {"--duplicate-stderr-filters", Flag::kNoEffect, true, true,
     "no line is copied to a file of its own; use --tee"},
    {"--help", Flag::kHelp, false, false},
    {"-h", Flag::kHelp, false, false},
};

/// `name` with each '_' after the leading dashes made '-': torchrun accepts
/// "--nproc_per_node" as well as "--nproc-per-node", and one table serves both.
std::string canonical_flag_name(const std::string& name);

/// Looks a flag up by its canonical name; nullptr when unknown.
const FlagSpec* find_flag(const std::string& canonical);

}  // namespace fsdp::launch::detail

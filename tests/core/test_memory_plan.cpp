// fsdp::plan_memory and fsdp::check_memory (Note [Memory plan]): what a
// step will still allocate is counted exactly from the units and the
// optimizer, and a model that does not fit fails before its first step on
// every rank, naming the rank, the memory and the bytes. On the CPU the units'
// memory is the host's; the GPU's pool is filled the same way from its device.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <string>
#include <vector>

#include <fsdp/fsdp.h>

#include "core/flat_parameter.h"
#include "error_of.h"
#include "memory/host_available.h"
#include "multi_rank.h"
#include "runtime/root_state.h"
#include "test_models.h"

namespace fsdp::testing {
namespace test_memory_plan {

// Bytes of every unit's trainable shard, and the working set Note [Memory
// plan] counts for them.
struct Expected {
  int64_t shards = 0;
  int64_t working_set = 0;
};

Expected expected_for(torch::nn::Module& model) {
  Expected e;
  int64_t gathered[2] = {0, 0};
  int64_t reducing = 0;
  for (Unit* unit : units_of(model)) {
    const FlatParameter& flat = *unit->flat_param();
    if (flat.shard().requires_grad()) e.shards += flat.shard().numel() * 4;
    const int64_t padded = flat.padded_numel() * 4;
    if (padded > gathered[0]) {
      gathered[1] = gathered[0];
      gathered[0] = padded;
    } else {
      gathered[1] = std::max(gathered[1], padded);
    }
    reducing = std::max(reducing, padded + flat.shard().numel() * 4);
  }
  e.working_set = gathered[0] + gathered[1] +
                  static_cast<int64_t>(detail::RootState::kMaxReductionsInFlight + 1) * reducing;
  return e;
}

void train_step(FullyShardedDataParallel<NetImpl>& model, torch::optim::Optimizer& optimizer,
                int world) {
  torch::manual_seed(7);
  const torch::Tensor x = torch::randn({4 * world, 7});
  optimizer.zero_grad();
  model->forward(local_block(x)).pow(2).sum().backward();
  optimizer.step();
}

TEST(MemoryPlan, CountsWhatTheFirstStepWillAllocate) {
  run_ranks_ok(2, [](int, int world) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    torch::manual_seed(0);
    FullyShardedDataParallel<NetImpl> model(std::make_shared<NetImpl>(true, FSDPOptions()),
                                            FSDPOptions());
    const Expected e = expected_for(*model.ptr());
    ASSERT_GT(e.shards, 0);

    torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-3));
    MemoryPlan plan = plan_memory(*model.ptr(), &adamw);
    EXPECT_TRUE(plan.device.is_cpu());
    EXPECT_EQ(plan.group->size(), world);
    // Units on the CPU: everything is host memory.
    EXPECT_EQ(plan.on_device.needed(), 0);
    EXPECT_EQ(plan.on_device.free, -1);
    EXPECT_EQ(plan.on_host.gradients, e.shards);
    EXPECT_EQ(plan.on_host.optimizer_state, 2 * e.shards) << "AdamW: two moments";
    EXPECT_EQ(plan.on_host.working_set, e.working_set);
    EXPECT_GT(plan.on_host.free, 0);
    EXPECT_TRUE(plan.on_host.fits());
    check_memory(*model.ptr(), &adamw);  // fits: no error, on both ranks

    // The optimizers' own counts, and none without an optimizer.
    torch::optim::AdamW amsgrad(model->parameters(), torch::optim::AdamWOptions().amsgrad(true));
    EXPECT_EQ(plan_memory(*model.ptr(), &amsgrad).on_host.optimizer_state, 3 * e.shards);
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
    EXPECT_EQ(plan_memory(*model.ptr(), &sgd).on_host.optimizer_state, 0);
    optim::FusedSGD momentum(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    EXPECT_EQ(plan_memory(*model.ptr(), &momentum).on_host.optimizer_state, e.shards);
    EXPECT_EQ(plan_memory(*model.ptr()).on_host.optimizer_state, 0);

    // After a step, the gradients and the state exist: nothing more to come
    // but the working set.
    train_step(model, adamw, world);
    plan = plan_memory(*model.ptr(), &adamw);
    EXPECT_EQ(plan.on_host.gradients, 0);
    EXPECT_EQ(plan.on_host.optimizer_state, 0);
    EXPECT_EQ(plan.on_host.working_set, e.working_set);
    // zero_grad(set_to_none) drops the gradients again: they count again.
    model->zero_grad(/*set_to_none=*/true);
    EXPECT_EQ(plan_memory(*model.ptr(), &adamw).on_host.gradients, e.shards);

    // A frozen unit gets no gradient and no state.
    for (Unit* unit : units_of(*model.ptr())) {
      unit->flat_param()->shard().requires_grad_(false);
      break;
    }
    EXPECT_LT(plan_memory(*model.ptr(), &adamw).on_host.gradients, e.shards);
  });
}

TEST(MemoryPlan, ModelThatDoesNotFitFailsOnEveryRankBeforeTheFirstStep) {
  run_ranks_ok(2, [](int rank, int world) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    torch::manual_seed(0);
    FullyShardedDataParallel<NetImpl> model(std::make_shared<NetImpl>(true, FSDPOptions()),
                                            FSDPOptions());
    torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-3));
    MemoryPlan plan = plan_memory(*model.ptr(), &adamw);
    if (rank == 1) plan.on_host.free = 1000;  // as if rank 1's host had 1000 bytes left
    const std::string msg = error_of([&] { check_memory(plan); });
    EXPECT_CONTAINS(msg, "[rank " + std::to_string(rank) + "] fsdp(check_memory): rank 1 needs ");
    EXPECT_CONTAINS(msg, "more host memory to train");
    EXPECT_CONTAINS(msg, "but 1000 B is free");
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    if (rank == 1) EXPECT_CONTAINS(msg, "optimizer state");
    // Nothing is lost: the group and the model still train.
    train_step(model, adamw, world);
    EXPECT_TRUE(units_of(*model.ptr()).front()->flat_param()->shard().grad().defined());
  });
}

TEST(MemoryPlan, ReadsTheHostsAndTheContainersRoom) {
  EXPECT_EQ(detail::mem_available_from_meminfo("MemTotal: 100 kB\nMemAvailable:   2048 kB\n"),
            2048 * 1024);
  EXPECT_EQ(detail::mem_available_from_meminfo("MemTotal: 100 kB\n"), -1);
  EXPECT_EQ(detail::cgroup_room("max\n", "123\n"), -1);
  EXPECT_EQ(detail::cgroup_room("1000\n", "400\n"), 600);
  EXPECT_EQ(detail::cgroup_room("1000\n", "4000\n"), 0);
  EXPECT_EQ(detail::cgroup_room("9223372036854771712\n", "400\n"), -1) << "v1's no limit";
  EXPECT_EQ(detail::cgroup_room("", ""), -1);
  // Page cache the kernel drops before it kills anything is room too.
  EXPECT_EQ(detail::cgroup_room("1000\n", "900\n", 500), 600);
  EXPECT_EQ(detail::cgroup_room("1000\n", "900\n", 2000), 1000);
  const std::string stat = "active_file 7\ninactive_file 500\ntotal_inactive_file 800\n";
  EXPECT_EQ(detail::stat_count(stat, "inactive_file"), 500);
  EXPECT_EQ(detail::stat_count(stat, "total_inactive_file"), 800);
  EXPECT_EQ(detail::stat_count(stat, "file"), -1);
  // The process's own cgroup: a SLURM job's below the root of a host
  // without a cgroup namespace, v2 or v1's memory controller.
  EXPECT_EQ(detail::cgroup_path("0::/system.slice/slurmstepd.scope/job_42\n", true),
            "/system.slice/slurmstepd.scope/job_42");
  const std::string v1 = "5:cpu,cpuacct:/x\n4:memory:/slurm/uid_0/job_42\n0::/\n";
  EXPECT_EQ(detail::cgroup_path(v1, false), "/slurm/uid_0/job_42");
  EXPECT_EQ(detail::cgroup_path(v1, true), "/");
  EXPECT_EQ(detail::cgroup_path("4:memory,hugetlb:/a\n", false), "/a");
  EXPECT_EQ(detail::cgroup_path("4:memoryx:/a\n", false), "");
  const int64_t available = detail::host_available_bytes();
  EXPECT_GT(available, 0);
}

// Memory the CPU block cache keeps after a large tensor is freed is counted
// as used by the kernel, but serves the next allocations: it is room.
TEST(MemoryPlan, TheBlockCachesFreeMemoryIsRoom) {
  enable_cpu_block_cache();
  empty_cpu_block_cache();
  {
    at::Tensor big = at::ones({int64_t{256} << 20}, at::kByte);  // touched: resident
  }
  const int64_t with_cache = detail::host_available_bytes();
  const int64_t room = detail::host_room_bytes();
  // Other processes change the host's memory between the two reads: a margin.
  EXPECT_NEAR(static_cast<double>(with_cache - room), static_cast<double>(int64_t{256} << 20),
              static_cast<double>(int64_t{32} << 20));
  empty_cpu_block_cache();
}

}  // namespace test_memory_plan
}  // namespace fsdp::testing

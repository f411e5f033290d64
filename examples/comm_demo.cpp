// The first multi-rank program: every rank all-gathers a shard into a flat
// buffer and reduce-scatters a flat buffer back into shards, then prints what
// it got. Run with:  build/bin/fsdprun --nproc-per-node 2 build/bin/comm_demo

#include <ATen/ATen.h>

#include <iostream>
#include <sstream>

#include <fsdp/fsdp.h>

namespace {
// "[0, 1, 2]": one line per tensor, so fsdprun's rank prefixes stay readable.
std::string list(const at::Tensor& t) {
  std::ostringstream os;
  os << "[";
  for (int64_t i = 0; i < t.numel(); ++i) os << (i ? ", " : "") << t[i].item<float>();
  os << "]";
  return os.str();
}
}  // namespace

int run() {
  auto pg = fsdp::init_process_group();
  const int rank = pg->rank(), world = pg->size();
  const int64_t shard_numel = 4;

  // All-gather: rank r contributes [10r, 10r+1, ...]; everyone gets all shards.
  at::Tensor shard = at::arange(shard_numel, at::kFloat) + 10.0 * rank;
  at::Tensor flat = at::empty({world * shard_numel});
  pg->all_gather_into_tensor(flat, shard).wait();
  std::cout << "rank " << rank << "/" << world << " (" << pg->backend_name()
            << ") all_gather of its shard " << list(shard) << " -> " << list(flat) << std::endl;

  // Reduce-scatter: rank r contributes (r + 1) * [0, 1, 2, ...]; the sum over
  // ranks is world(world+1)/2 * [0, 1, ...], and rank r keeps its shard of it.
  at::Tensor grads = at::arange(world * shard_numel, at::kFloat) * (rank + 1);
  at::Tensor reduced = at::empty({shard_numel});
  pg->reduce_scatter_tensor(reduced, grads, fsdp::ReduceOp::kSum).wait();
  at::Tensor expected = at::arange(rank * shard_numel, (rank + 1) * shard_numel, at::kFloat) *
                        (world * (world + 1) / 2);
  std::cout << "rank " << rank << " reduce_scatter(sum) -> " << list(reduced)
            << (at::equal(reduced, expected) ? " (correct)" : " (WRONG)") << std::endl;

  at::Tensor count = at::ones({1});
  pg->all_reduce(count).wait();
  pg->barrier().wait();
  if (rank == 0) std::cout << "all_reduce counted " << count.item<float>() << " ranks" << std::endl;
  return at::equal(reduced, expected) ? 0 : 1;
}

// Errors in one line: a c10::Error's what() carries a C++ backtrace
// (TORCH_SHOW_CPP_STACKTRACES=1 shows it).
int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    std::cerr << fsdp::error_message(e) << std::endl;
    return 1;
  }
}

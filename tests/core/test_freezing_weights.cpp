// Port of PyTorch's test_fsdp_freezing_weights (seed 000): all 32 combinations
// of nested trunk or not x freeze by requires_grad or by grad-to-none x
// freeze before or after wrapping x trunk under no_grad or not x forward
// prefetch on or off, 3 SGD steps (lr 0.1, momentum 0.9) at world sizes 1, 2
// and 3, each rank on its own images, against plain LibTorch training of the
// same model on all ranks' images (mean loss), compared after every step. An
// 8x8 image instead of 224x224 keeps CI fast (LibTorch 1.13 convolves through
// a generic OpenBLAS on CI's machine); the structure is the seed's.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <sstream>

#include <fsdp/fsdp.h>

#include "multi_rank.h"
#include "seed_ports.h"
#include "test_models.h"

namespace fsdp::testing {
namespace test_freezing_weights {

namespace nn = torch::nn;

enum class Freezing { kRequiresGrad, kGradToNone };

struct Combo {
  bool nested_trunk;
  Freezing freezing;
  bool freeze_after_wrap;
  bool disable_autograd;
  bool forward_prefetch;
  std::string name() const {
    std::ostringstream os;
    os << "nested=" << nested_trunk
       << " freezing=" << (freezing == Freezing::kRequiresGrad ? "requires_grad" : "grad_to_none")
       << " freeze_after_wrap=" << freeze_after_wrap << " disable_autograd=" << disable_autograd
       << " forward_prefetch=" << forward_prefetch;
    return os.str();
  }
};

// A Sequential with a concrete forward, so it can be an entry of another
// Sequential (LibTorch cannot nest plain Sequentials): the seed's block.
struct BlockImpl : nn::SequentialImpl {
  using nn::SequentialImpl::SequentialImpl;
  torch::Tensor forward(torch::Tensor x) { return nn::SequentialImpl::forward(x); }
};
TORCH_MODULE(Block);

// The seed's Model and NestedTrunkModel in one class. trunk and head are
// plain modules until fsdp_wrap() makes them units in place (as the seed's
// fsdp_wrap replaces attributes).
struct SeedModelImpl : nn::Module {
  SeedModelImpl(bool nested, bool disable_autograd)
      : nested_(nested), no_grad_trunk_(disable_autograd) {
    if (!nested) {
      trunk_ =
          nn::Sequential(nn::Conv2d(nn::Conv2dOptions(3, 64, 3)), nn::ReLU(nn::ReLUOptions(true)),
                         nn::AdaptiveAvgPool2d(nn::AdaptiveAvgPool2dOptions(1)), nn::Flatten());
      head_ = nn::Sequential(nn::Linear(64, 10));
    } else {
      trunk_ = nn::Sequential(
          Block(nn::Conv2d(nn::Conv2dOptions(3, 64, 3)), nn::ReLU(nn::ReLUOptions(true))),
          Block(nn::Conv2d(nn::Conv2dOptions(64, 64, 3)), nn::ReLU(nn::ReLUOptions(true))));
      head_ = nn::Sequential(nn::AdaptiveAvgPool2d(nn::AdaptiveAvgPool2dOptions(1)), nn::Flatten(),
                             nn::Linear(64, 10));
    }
    register_module("trunk", trunk_);
    register_module("head", head_);
  }

  void fsdp_wrap(const FSDPOptions& o) {
    if (nested_) {
      for (size_t i = 0; i < trunk_->size(); ++i) wrap_sequential_entry(trunk_, i, o);
    }
    trunk_unit_ = FullyShardedDataParallel<nn::SequentialImpl>(trunk_, o);
    head_unit_ = FullyShardedDataParallel<nn::SequentialImpl>(head_, o);
    replace_module("trunk", trunk_unit_.ptr());
    replace_module("head", head_unit_.ptr());
  }

  torch::Tensor forward(torch::Tensor x) {
    {
      std::unique_ptr<torch::NoGradGuard> guard;
      if (no_grad_trunk_) guard = std::make_unique<torch::NoGradGuard>();
      x = trunk_unit_ ? trunk_unit_->forward(x) : trunk_->forward(x);
    }
    return head_unit_ ? head_unit_->forward(x) : head_->forward(x);
  }

  // The seed's model.trunk.parameters(): the flat shards once wrapped.
  std::vector<torch::Tensor> trunk_parameters() {
    return trunk_unit_ ? trunk_unit_->parameters() : trunk_->parameters();
  }

  bool nested_, no_grad_trunk_;
  nn::Sequential trunk_{nullptr}, head_{nullptr};
  FullyShardedDataParallel<nn::SequentialImpl> trunk_unit_{nullptr}, head_unit_{nullptr};
};
TORCH_MODULE(SeedModel);

void freeze_by_requires_grad(SeedModel& model) {
  for (auto& p : model->trunk_parameters()) p.set_requires_grad(false);
}

// Trains 3 steps on `device`, with FSDP on this rank's block of the global
// batch, else on all of it; returns the full parameters (gathered when
// wrapped) after each.
std::vector<ParamSnapshot> train(const Combo& c, bool with_fsdp, const torch::Device& device) {
  const int world = rank_and_world().second;
  torch::manual_seed(0);
  const torch::Tensor images = torch::randn({2 * world, 3, 8, 8}).to(device);
  const torch::Tensor labels = (torch::arange(2 * world, torch::kLong) % 10).to(device);
  const torch::Tensor batch = batch_for(images, with_fsdp);
  const torch::Tensor target = batch_for(labels, with_fsdp);
  const auto options = FSDPOptions().forward_prefetch(c.forward_prefetch);
  SeedModel model(c.nested_trunk, c.disable_autograd);
  model->to(device);  // as the seed's model.cuda(), before wrapping
  if (with_fsdp && c.freeze_after_wrap) model->fsdp_wrap(options);
  if (c.freezing == Freezing::kRequiresGrad) freeze_by_requires_grad(model);
  std::function<torch::Tensor(torch::Tensor)> forward = [&](torch::Tensor x) {
    return model->forward(x);
  };
  std::vector<torch::Tensor> params = model->parameters();
  FullyShardedDataParallel<SeedModelImpl> root{nullptr};
  if (with_fsdp) {
    if (!c.freeze_after_wrap) model->fsdp_wrap(options);
    root = FullyShardedDataParallel<SeedModelImpl>(model, options);
    forward = [&](torch::Tensor x) { return root->forward(x); };
    params = root->parameters();
  }
  torch::optim::SGD optimizer(params, torch::optim::SGDOptions(0.1).momentum(0.9));
  std::vector<ParamSnapshot> history;
  for (int step = 0; step < 3; ++step) {
    torch::Tensor out = forward(batch);
    torch::Tensor loss = torch::nn::functional::cross_entropy(out, target);
    optimizer.zero_grad();
    loss.backward();
    if (c.freezing == Freezing::kGradToNone) {
      for (auto& p : model->trunk_parameters()) p.mutable_grad().reset();
    }
    optimizer.step();
    std::unique_ptr<SummonFullParams> full;
    if (with_fsdp) full = std::make_unique<SummonFullParams>(*root.ptr());
    history.push_back(snapshot_params(*model));
  }
  return history;
}

}  // namespace test_freezing_weights

void check_freezing_weights(const torch::Device& device) {
  using namespace test_freezing_weights;
  for (const int world : parity_world_sizes()) {
    SCOPED_TRACE("world " + std::to_string(world));
    run_ranks_ok(world, [device](int, int) {
      torch::set_num_threads(1);
      init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
      int checked = 0;
      for (bool nested : {true, false}) {
        for (Freezing freezing : {Freezing::kRequiresGrad, Freezing::kGradToNone}) {
          for (bool after : {true, false}) {
            for (bool no_grad : {true, false}) {
              for (bool prefetch : {true, false}) {
                const Combo c{nested, freezing, after, no_grad, prefetch};
                const auto expected = train(c, /*with_fsdp=*/false, device);
                const auto actual = train(c, /*with_fsdp=*/true, device);
                expect_same_history(actual, expected, c.name(),
                                    /*check_requires_grad=*/freezing == Freezing::kRequiresGrad);
                ++checked;
              }
            }
          }
        }
      }
      EXPECT_EQ(checked, 32);
    });
  }
}

namespace test_freezing_weights {

TEST(FreezingWeights, AllCombinationsMatchPlainTraining) { check_freezing_weights(torch::kCPU); }

}  // namespace test_freezing_weights
}  // namespace fsdp::testing

// Deferred (meta-device) initialisation: the port of PyTorch's
// test_fsdp_meta.py (seed 002). A model built on the meta device and wrapped
// (auto-wrap with always_wrap, or enable_wrap/wrap) with the default
// initialisation (fsdp::reset_parameters) or a param_init_fn ends with the
// parameters and buffers of a normally built model plus the same resets,
// before and after one SGD step; an empty param_init_fn is rejected; meta
// init combined with mixed precision (param fp32, reduce fp16) trains like
// plain LibTorch; sync_module_states gives every rank rank 0's model.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>

#include <fsdp/fsdp.h>

#include "core/flat_parameter.h"
#include "error_of.h"
#include "multi_rank.h"
#include "seed_ports.h"
#include "test_models.h"

namespace fsdp::testing {
namespace test_meta_init {

namespace nn = torch::nn;

// Linear without bias whose reset draws the same values every time
// (PyTorch's MyLinear: seed 42, xavier_uniform_).
struct MyLinearImpl : nn::Module {
  MyLinearImpl(int64_t in, int64_t out, torch::Device device) {
    weight = register_parameter("weight", torch::empty({out, in}, torch::device(device)));
    if (!weight.is_meta()) reset_parameters();
  }
  void reset_parameters() {
    torch::manual_seed(42);
    torch::NoGradGuard no_grad;
    nn::init::xavier_uniform_(weight, 1.0);
  }
  torch::Tensor forward(torch::Tensor x) { return torch::matmul(x, weight.t()); }
  torch::Tensor weight;
};
TORCH_MODULE(MyLinear);

// A module with only a buffer, reset with its own values (PyTorch's MyBuffer).
struct MyBufferImpl : nn::Module {
  explicit MyBufferImpl(torch::Device device) {
    buf = register_buffer("buf", torch::empty({3, 3}, torch::device(device)));
  }
  void reset_parameters() {
    torch::manual_seed(42);
    torch::NoGradGuard no_grad;
    nn::init::xavier_uniform_(buf, 0.5);
  }
  torch::Tensor forward(torch::Tensor x) { return x; }
  torch::Tensor buf;
};
TORCH_MODULE(MyBuffer);

// PyTorch's MyModel (lin2(lin1(x)), buf_mod unused) as Sequential entries, so
// auto_wrap can make every module a unit.
struct MyModelImpl : nn::SequentialImpl {
  explicit MyModelImpl(torch::Device device) {
    push_back(MyLinear(2, 2, device));
    push_back(MyLinear(2, 2, device));
    push_back(MyBuffer(device));
  }
  torch::Tensor forward(torch::Tensor x) { return nn::SequentialImpl::forward(x); }
};
TORCH_MODULE(MyModel);

// PyTorch's NestedModel: l3(lin2(lin1(x))), lin1 and l3 through fsdp::wrap()
// (units inside an EnableWrap scope, the modules themselves outside).
struct NestedModelImpl : nn::SequentialImpl {
  NestedModelImpl(torch::Device device, bool use_wrap) {
    if (use_wrap) {
      push_back(wrap(MyLinear(2, 2, device)));
      push_back(MyLinear(2, 2, device));
      push_back(wrap(MyModel(device)));
    } else {
      push_back(MyLinear(2, 2, device));
      push_back(MyLinear(2, 2, device));
      push_back(MyModel(device));
    }
  }
  torch::Tensor forward(torch::Tensor x) { return nn::SequentialImpl::forward(x); }
};
TORCH_MODULE(NestedModel);

void register_test_resets() {
  register_reset_parameters<MyLinearImpl>();
  register_reset_parameters<MyBufferImpl>();
}

// The seed's _reset_params_if_meta: every module that has a reset, in order.
void reset_all(nn::Module& model) {
  for (const auto& m : model.modules(/*include_self=*/true)) {
    if (has_reset_parameters(*m)) reset_parameters(*m);
  }
}

// The C++ form of the seed's _init_with_reset_params, counting its calls.
struct InitFn {
  std::shared_ptr<int> calls = std::make_shared<int>(0);
  std::function<void(nn::Module&)> fn() const {
    auto c = calls;
    return [c](nn::Module& m) {
      ++*c;
      if (auto* l = dynamic_cast<MyLinearImpl*>(&m)) l->reset_parameters();
      if (auto* b = dynamic_cast<MyBufferImpl*>(&m)) b->reset_parameters();
    };
  }
};

bool any_meta(nn::Module& m) {
  for (const auto& p : m.parameters()) {
    if (p.is_meta()) return true;
  }
  for (const auto& b : m.buffers()) {
    if (b.is_meta()) return true;
  }
  return false;
}

void expect_same_buffers(nn::Module& actual, nn::Module& expected, const std::string& what) {
  auto exp = expected.named_buffers();
  auto act = actual.named_buffers();
  ASSERT_EQ(act.size(), exp.size()) << what;
  for (const auto& b : exp) {
    const torch::Tensor* a = act.find(b.key());
    ASSERT_NE(a, nullptr) << what << ": missing buffer " << b.key();
    EXPECT_TRUE(torch::equal(*a, b.value())) << what << " buffer " << b.key();
  }
}

// The seed's comparison: full parameters (and buffers) before training; then
// 3 SGD steps, the FSDP model on this rank's block of a global batch and the
// regular one on all of it (sum loss / world: what averaging the ranks'
// gradients computes), full parameters compared after each.
template <typename Root>
void compare_train_compare(Root& fsdp_model, nn::Module& regular,
                           const std::function<torch::Tensor(torch::Tensor)>& regular_forward,
                           const std::string& what) {
  {
    SummonFullParams full(*fsdp_model.ptr());
    expect_same_params(*fsdp_model.ptr(), regular, what + " before training");
    expect_same_buffers(*fsdp_model.ptr(), regular, what);
  }
  torch::optim::SGD meta_opt(fsdp_model->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD regular_opt(regular.parameters(), torch::optim::SGDOptions(0.1));
  const int world = rank_and_world().second;
  const torch::Device device = regular.parameters().front().device();
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(5 + step);  // the same global batch on every rank
    const torch::Tensor global = torch::randn({4 * world, 2}).to(device);
    meta_opt.zero_grad();
    regular_opt.zero_grad();
    fsdp_model->forward(local_block(global)).sum().backward();
    (regular_forward(global).sum() / world).backward();
    meta_opt.step();
    regular_opt.step();
    expect_same_after_step(*fsdp_model.ptr(), regular, what, step);
  }
}

std::shared_ptr<ProcessGroup> start_rank() {
  torch::set_num_threads(1);
  register_test_resets();
  return init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
}

torch::nn::Sequential as_sequential(const std::shared_ptr<nn::SequentialImpl>& impl) {
  return torch::nn::Sequential(impl);
}

// Units materialise meta models on `device` (PyTorch's device_id).
FSDPOptions options_on(const torch::Device& device) {
  FSDPOptions o;
  if (!device.is_cpu()) o.device_id(device);
  return o;
}

}  // namespace test_meta_init

void check_meta_init_simple(const torch::Device& device) {
  using namespace test_meta_init;
  for (const int world : parity_world_sizes()) {
    SCOPED_TRACE("world " + std::to_string(world));
    run_ranks_ok(world, [device](int, int) {
      const auto group = start_rank();
      for (const bool with_fn : {false, true}) {
        const std::string label = with_fn ? "param_init_fn" : "default init";
        InitFn init;
        FSDPOptions o = options_on(device);
        if (with_fn) o.param_init_fn(init.fn());

        // Every module a unit (always_wrap).
        MyModel meta(torch::kMeta);
        ASSERT_TRUE(any_meta(*meta));
        auto seq = as_sequential(meta.ptr());
        auto units = auto_wrap(seq, AlwaysWrapPolicy(), o);
        EXPECT_EQ(units.size(), 3u);
        FullyShardedDataParallel<MyModelImpl> fsdp_meta(meta, o);
        EXPECT_FALSE(any_meta(*fsdp_meta)) << label;
        if (with_fn) EXPECT_EQ(*init.calls, 3) << "once per module with meta state";
        MyModel regular(device);
        reset_all(*regular);
        compare_train_compare(
            fsdp_meta, *regular, [&](torch::Tensor x) { return regular->forward(x); },
            label + ", always_wrap");

        // One unit holding every module.
        *init.calls = 0;
        MyModel meta2(torch::kMeta);
        FullyShardedDataParallel<MyModelImpl> fsdp_meta2(meta2, o);
        if (with_fn) EXPECT_EQ(*init.calls, 3);
        MyModel regular2(device);
        reset_all(*regular2);
        compare_train_compare(
            fsdp_meta2, *regular2, [&](torch::Tensor x) { return regular2->forward(x); },
            label + ", single unit");
      }
      group->barrier().wait();
    });
  }
}

void check_meta_init_nested(const torch::Device& device) {
  using namespace test_meta_init;
  for (const int world : parity_world_sizes()) {
    SCOPED_TRACE("world " + std::to_string(world));
    run_ranks_ok(world, [device](int, int) {
      const auto group = start_rank();
      for (const bool with_fn : {false, true}) {
        for (const bool auto_wrapped : {true, false}) {
          const std::string label = std::string(with_fn ? "param_init_fn" : "default init") +
                                    (auto_wrapped ? ", auto_wrap" : ", enable_wrap");
          InitFn init;
          FSDPOptions o = options_on(device);
          if (with_fn) o.param_init_fn(init.fn());
          FullyShardedDataParallel<NestedModelImpl> fsdp_meta{nullptr};
          if (auto_wrapped) {
            NestedModel meta(torch::kMeta, /*use_wrap=*/false);
            auto seq = as_sequential(meta.ptr());
            auto_wrap(seq, AlwaysWrapPolicy(), o);
            fsdp_meta = FullyShardedDataParallel<NestedModelImpl>(meta, o);
          } else {
            EnableWrap scope(o);
            // The units are made (and materialised) while the model is built.
            NestedModel meta(torch::kMeta, /*use_wrap=*/true);
            fsdp_meta = wrap(meta);
            ASSERT_TRUE(fsdp_meta->enabled());
          }
          EXPECT_FALSE(any_meta(*fsdp_meta)) << label;
          if (with_fn) EXPECT_EQ(*init.calls, 5) << label;
          NestedModel regular(device, /*use_wrap=*/false);
          reset_all(*regular);
          compare_train_compare(
              fsdp_meta, *regular, [&](torch::Tensor x) { return regular->forward(x); }, label);
        }
      }
      group->barrier().wait();
    });
  }
}

namespace test_meta_init {

TEST(MetaInit, SimpleModelDefaultInitAndParamInitFn) { check_meta_init_simple(torch::kCPU); }

TEST(MetaInit, NestedModelAutoWrapAndEnableWrap) { check_meta_init_nested(torch::kCPU); }

TEST(MetaInit, EmptyParamInitFnIsRejected) {
  run_ranks_ok(2, [](int, int) {
    const auto group = start_rank();
    const auto o = FSDPOptions().param_init_fn(std::function<void(nn::Module&)>());
    NestedModel meta(torch::kMeta, /*use_wrap=*/false);
    std::string msg = error_of([&] { FullyShardedDataParallel<NestedModelImpl> m(meta, o); });
    EXPECT_NE(msg.find("to be callable"), std::string::npos) << msg;
    auto seq = as_sequential(meta.ptr());
    msg = error_of([&] { auto_wrap(seq, AlwaysWrapPolicy(), o); });
    EXPECT_NE(msg.find("to be callable"), std::string::npos) << msg;
    EXPECT_NE(dynamic_cast<MyLinearImpl*>(meta->ptr(0).get()), nullptr) << "nothing wrapped";
    group->barrier().wait();
  });
}

// The seed's FakeLinear: a weight used as x @ weight.
struct FakeLinearImpl : nn::Module {
  FakeLinearImpl(int64_t in, int64_t out) {
    weight = register_parameter("weight", torch::randn({in, out}));
  }
  torch::Tensor forward(torch::Tensor x) { return torch::matmul(x, weight); }
  torch::Tensor weight;
};
TORCH_MODULE(FakeLinear);

struct MpModelImpl : nn::SequentialImpl {
  MpModelImpl() {
    push_back(nn::Linear(5, 5));
    push_back(nn::ReLU());
    push_back(FakeLinear(5, 5));
  }
  torch::Tensor forward(torch::Tensor x) { return nn::SequentialImpl::forward(x); }
};
TORCH_MODULE(MpModel);

// Moves every parameter and buffer of `m` to the meta device, keeping the
// tensor objects (C++ modules such as nn::Linear cannot be built on meta).
void to_meta(nn::Module& m) {
  for (auto t : m.parameters()) {
    t.unsafeGetTensorImpl()->shallow_copy_from(
        torch::empty(t.sizes(), t.options().device(torch::kMeta)).getIntrusivePtr());
  }
  for (auto t : m.buffers()) {
    t.unsafeGetTensorImpl()->shallow_copy_from(
        torch::empty(t.sizes(), t.options().device(torch::kMeta)).getIntrusivePtr());
  }
}

// The seed's _module_init_fn, drawing fixed values per module.
void mp_module_init(nn::Module& m) {
  torch::NoGradGuard no_grad;
  if (auto* l = dynamic_cast<nn::LinearImpl*>(&m)) {
    torch::manual_seed(11);
    l->weight.normal_(0.0, 0.1);
    l->bias.zero_();
  }
  if (auto* f = dynamic_cast<FakeLinearImpl*>(&m)) {
    torch::manual_seed(12);
    f->weight.normal_(0.0, 0.1);
  }
}

TEST(MetaInit, WithMixedPrecisionParamFp32ReduceFp16) {
  run_ranks_ok(2, [](int rank, int) {
    const auto group = start_rank();
    MpModel model;
    to_meta(*model);
    const auto o =
        FSDPOptions()
            .mixed_precision(
                MixedPrecision().param_dtype(torch::kFloat32).reduce_dtype(torch::kFloat16))
            .param_init_fn(mp_module_init);
    auto seq = as_sequential(model.ptr());
    auto units = auto_wrap(seq, module_type_policy<nn::LinearImpl>(), o);
    ASSERT_EQ(units.size(), 1u);
    FullyShardedDataParallel<MpModelImpl> fsdp_model(model, o);
    ASSERT_NE(fsdp_model->flat_param(), nullptr);
    EXPECT_EQ(fsdp_model->flat_param()->grad_dtype(), torch::kFloat16);

    MpModel regular;
    for (const auto& m : regular->modules()) mp_module_init(*m);
    {
      SummonFullParams full(*fsdp_model.ptr());
      expect_same_params(*fsdp_model.ptr(), *regular, "meta + mixed precision before training");
    }
    // Different data per rank: the reference averages both ranks' gradients.
    torch::optim::SGD opt(fsdp_model->parameters(), torch::optim::SGDOptions(0.1));
    torch::optim::SGD ref_opt(regular->parameters(), torch::optim::SGDOptions(0.1));
    torch::manual_seed(100 + rank);
    torch::Tensor x = torch::randn({6, 5});
    fsdp_model->forward(x).pow(2).sum().backward();
    opt.step();
    for (int r = 0; r < 2; ++r) {
      torch::manual_seed(100 + r);
      (regular->forward(torch::randn({6, 5})).pow(2).sum() / 2).backward();
    }
    ref_opt.step();
    for (const auto& p : fsdp_model->parameters()) {
      EXPECT_EQ(p.scalar_type(), torch::kFloat32);
      ASSERT_TRUE(p.grad().defined());
      EXPECT_EQ(p.grad().scalar_type(), torch::kFloat32) << "cast back from the fp16 reduction";
    }
    SummonFullParams full(*fsdp_model.ptr());
    for (const auto& p : regular->named_parameters()) {
      const torch::Tensor& a = fsdp_model->named_parameters()[p.key()];
      EXPECT_TRUE(torch::allclose(a, p.value(), /*rtol=*/1e-3, /*atol=*/1e-3))
          << p.key() << " max diff " << (a - p.value()).abs().max().item<double>();
    }
  });
}

TEST(MetaInit, SyncModuleStatesGivesEveryRankRankZerosModel) {
  run_ranks_ok(2, [](int rank, int) {
    const auto group = start_rank();
    auto build = [](int seed, float stat) {
      torch::manual_seed(seed);
      nn::Sequential s(nn::Linear(4, 8), nn::BatchNorm1d(8), nn::ReLU(), nn::Linear(8, 3));
      auto* bn = s->ptr(1)->as<nn::BatchNorm1d>();
      bn->running_mean.fill_(stat);
      bn->num_batches_tracked.fill_(static_cast<int64_t>(stat) + 3);
      return s;
    };
    nn::Sequential model = build(rank, static_cast<float>(rank + 1));  // differs per rank
    const auto o = FSDPOptions().sync_module_states(true);
    auto_wrap(model, module_type_policy<nn::LinearImpl>(), o);
    FullyShardedDataParallel<nn::SequentialImpl> root(model, o);
    nn::Sequential expected = build(0, 1.0f);  // rank 0's model
    SummonFullParams full(*root.ptr());
    expect_same_params(*root.ptr(), *expected,
                       "sync_module_states on rank " + std::to_string(rank));
    expect_same_buffers(*root.ptr(), *expected, "sync_module_states buffers");
  });
}

// A module on the meta device with no known reset is refused before any of
// the model is materialised: it stays on meta, and once a reset is
// registered the same model wraps and is initialised.
struct UnresettableImpl : nn::Module {
  UnresettableImpl() { w = register_parameter("w", torch::empty({4, 2}, torch::kMeta)); }
  void reset_parameters() {
    torch::NoGradGuard no_grad;
    w.fill_(0.5);
  }
  torch::Tensor forward(torch::Tensor x) { return torch::matmul(x, w.t()); }
  torch::Tensor w;
};
TORCH_MODULE(Unresettable);

struct HalfResettableImpl : nn::Module {
  HalfResettableImpl() {
    fc = register_module("fc", nn::Linear(2, 2));
    to_meta(*fc);
    other = register_module("other", Unresettable());
  }
  torch::Tensor forward(torch::Tensor x) { return other(fc(x)); }
  nn::Linear fc{nullptr};
  Unresettable other{nullptr};
};
TORCH_MODULE(HalfResettable);

TEST(MetaInit, AModuleWithoutAResetIsRefusedWithTheModelLeftOnMeta) {
  run_ranks_ok(1, [](int, int) {
    const auto group = start_rank();
    HalfResettable model;
    const std::string msg =
        error_of([&] { FullyShardedDataParallel<HalfResettableImpl> unit(model, FSDPOptions()); });
    EXPECT_NE(msg.find("register_reset_parameters"), std::string::npos) << msg;
    for (const auto& p : model->parameters()) EXPECT_TRUE(p.is_meta()) << "materialised anyway";
    register_reset_parameters<UnresettableImpl>();
    FullyShardedDataParallel<HalfResettableImpl> unit(model, FSDPOptions());
    SummonFullParams full(*unit);
    EXPECT_TRUE(torch::equal(unit->module().other->w, torch::full({4, 2}, 0.5F)));
  });
}

}  // namespace test_meta_init
}  // namespace fsdp::testing

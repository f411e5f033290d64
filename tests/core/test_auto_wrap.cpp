// fsdp::auto_wrap and its policies (PyTorch's _wrap_utils.py / wrap.py, seed
// 003): which modules each policy selects, in post-order with only unwrapped
// parameters counted; in-place wrapping of Sequential entries keeping
// parameter names; training parity against plain LibTorch; the refusals
// (a tree already holding units, a selected module no slot calls).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <fsdp/fsdp.h>

#include "error_of.h"
#include "multi_rank.h"
#include "test_models.h"

namespace fsdp::testing {
namespace test_auto_wrap {

namespace nn = torch::nn;
using Paths = std::vector<std::string>;

// A Sequential with a concrete forward, so it can be an entry of another
// Sequential; auto_wrap looks inside it.
struct BlockImpl : nn::SequentialImpl {
  using nn::SequentialImpl::SequentialImpl;
  torch::Tensor forward(torch::Tensor x) { return nn::SequentialImpl::forward(x); }
};
TORCH_MODULE(Block);

// An entry whose Linears are typed members: no slot calls them.
struct MlpImpl : nn::Module {
  MlpImpl()
      : fc1(register_module("fc1", nn::Linear(16, 16))),
        fc2(register_module("fc2", nn::Linear(16, 16))) {}
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
  nn::Linear fc1, fc2;
};
TORCH_MODULE(Mlp);

// A Sequential that registers a module besides its entries, before them: its
// entry 0 is its child 1.
struct TaggedImpl : nn::SequentialImpl {
  TaggedImpl() {
    register_module("tag", nn::Linear(2, 2));
    push_back(nn::Linear(16, 16));
  }
  torch::Tensor forward(torch::Tensor x) { return nn::SequentialImpl::forward(x); }
};
TORCH_MODULE(Tagged);

// Parameter counts: 0: 144, 2: 32, 3: 576 (3.0: 272, 3.2: 32, 3.3: 272), 4: 68.
// `pass_through`: entries 0, 3.0 and 4 made by fsdp::wrap() outside any
// EnableWrap scope, as model code that calls wrap() unconditionally makes
// them (the same modules and values).
nn::Sequential make_model(bool pass_through = false) {
  torch::manual_seed(0);
  nn::Linear first(8, 16);
  nn::LayerNorm norm(nn::LayerNormOptions({16}));
  nn::Linear inner(16, 16);
  nn::LayerNorm inner_norm(nn::LayerNormOptions({16}));
  nn::Linear inner_last(16, 16), last(16, 4);
  if (!pass_through) {
    return nn::Sequential(first, nn::ReLU(), norm, Block(inner, nn::ReLU(), inner_norm, inner_last),
                          last);
  }
  return nn::Sequential(wrap(first), nn::ReLU(), norm,
                        Block(wrap(inner), nn::ReLU(), inner_norm, inner_last), wrap(last));
}

struct PolicyCase {
  std::string name;
  AutoWrapPolicy policy;
  Paths expected;
};

// The Linears, the one at 3.0 with SHARD_GRAD_OP.
CustomPolicy linears_inner_first_grad_op() {
  return CustomPolicy([](const nn::Module& m, const std::string& path, int64_t, FSDPOptions& o) {
    if (m.as<nn::LinearImpl>() == nullptr) return false;
    if (path == "3.0") o.sharding_strategy(ShardingStrategy::kShardGradOp);
    return true;
  });
}

std::vector<PolicyCase> policy_cases() {
  return {
      {"always", AlwaysWrapPolicy(), {"0", "1", "2", "3.0", "3.1", "3.2", "3.3", "3", "4"}},
      {"linear", module_type_policy<nn::LinearImpl>(), {"0", "3.0", "3.3", "4"}},
      {"block", module_type_policy<BlockImpl>(), {"3"}},
      {"linear_and_block",
       module_type_policy<nn::LinearImpl, BlockImpl>(),
       {"0", "3.0", "3.3", "3", "4"}},
      // isinstance semantics: a subclass matches; the root is never a candidate.
      {"sequential_subclass", module_type_policy<nn::SequentialImpl>(), {"3"}},
      // The block holds 576 but only its LayerNorm's 32 are left unwrapped.
      {"min_250", MinParamsPolicy(250), {"3.0", "3.3"}},
      {"min_300", MinParamsPolicy(300), {"3"}},
      {"min_144_inclusive", MinParamsPolicy(144), {"0", "3.0", "3.3"}},
      {"min_default", MinParamsPolicy(), {}},
      {"min_30", MinParamsPolicy(30), {"0", "2", "3.0", "3.2", "3.3", "4"}},
      // PyTorch's exclude_wrap_modules: LayerNorms are never selected, so the
      // block keeps 32 of its own and is selected after its Linears.
      {"min_30_norms_excluded",
       MinParamsPolicy(30, MinParamsPolicy::default_force_leaf_modules(),
                       {module_class<nn::LayerNormImpl>()}),
       {"0", "3.0", "3.3", "3", "4"}},
      // PyTorch's force_leaf_modules: the block is not looked into, so
      // neither it nor its Linears are asked (as _recursive_wrap asks no
      // module it does not recurse into): its parameters join the root.
      {"min_100_block_a_leaf",
       MinParamsPolicy(100, {module_class<BlockImpl>()},
                       MinParamsPolicy::default_exclude_wrap_modules()),
       {"0"}},
      {"min_100", MinParamsPolicy(100), {"0", "3.0", "3.3"}},
      {"lambda",
       LambdaPolicy([](const nn::Module&, const std::string& path, int64_t numel) {
         return path.rfind("3.", 0) == 0 && numel > 0;
       }),
       {"3.0", "3.2", "3.3"}},
      {"union",
       module_type_policy<nn::LayerNormImpl>() | MinParamsPolicy(250),
       {"2", "3.0", "3.2", "3.3"}},
      // PyTorch's CustomPolicy: the block's first Linear keeps its
      // parameters gathered after forward; training is the same.
      {"custom", linears_inner_first_grad_op(), {"0", "3.0", "3.3", "4"}},
  };
}

std::vector<std::string> names_of(const nn::Module& m) {
  std::vector<std::string> out;
  for (const auto& p : m.named_parameters()) out.push_back(p.key());
  return out;
}

// Joins the world group of a rank process.
std::shared_ptr<ProcessGroup> start_rank() {
  torch::set_num_threads(1);
  return init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
}

// Ends a rank body. A rank whose body makes no collective could otherwise
// exit while its peer is still connecting to it (Gloo then fails the peer).
void finish_rank(const std::shared_ptr<ProcessGroup>& group) { group->barrier().wait(); }

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(AutoWrapPolicies, EachPolicySelectsTheExpectedPaths) {
  for (const auto& c : policy_cases()) {
    EXPECT_EQ(auto_wrap_paths(make_model(), c.policy), c.expected) << c.name;
  }
  EXPECT_EQ((module_type_policy<nn::LinearImpl>() | MinParamsPolicy(7)).description(),
            "(ModuleTypePolicy(torch::nn::LinearImpl) | MinParamsPolicy(7))");
  EXPECT_TRUE(contains(error_of([] { MinParamsPolicy(-1); }), "got -1"));
  // Planned with the options auto_wrap would get (it used to plan with
  // none): an ignored entry is no unit.
  nn::Sequential model = make_model();
  const auto linears = module_type_policy<nn::LinearImpl>();
  Paths without_first = auto_wrap_paths(model, linears);
  ASSERT_EQ(without_first.front(), "0");
  without_first.erase(without_first.begin());
  EXPECT_EQ(auto_wrap_paths(model, linears, FSDPOptions().ignored_modules({model->ptr(0)})),
            without_first);
}

// A MinParamsPolicy with other classes than PyTorch's defaults names them in
// its description; a class without a test is refused when the policy is made.
TEST(AutoWrapPolicies, MinParamsPolicyNamesClassesOtherThanTheDefaults) {
  EXPECT_EQ(MinParamsPolicy(10).description(), "MinParamsPolicy(10)");
  const std::string named =
      MinParamsPolicy(10, {}, MinParamsPolicy::default_exclude_wrap_modules()).description();
  EXPECT_EQ(named, "MinParamsPolicy(10, force_leaf_modules={})");
  EXPECT_TRUE(contains(error_of([] {
                         MinParamsPolicy(1, {ModuleClass{"Block", nullptr}}, {});
                       }),
                       "the class 'Block' of force_leaf_modules has an empty matches function"));
}

// Activation checkpointing applied before auto_wrap: the block's entry is an
// AnyCheckpointWrapper now, and the policies are asked about the block it
// wraps (a review found none matched it, so no unit was made of it).
TEST(AutoWrapPolicies, PoliciesSeeTheModuleInsideACheckpointWrapper) {
  const auto is_block = [](const nn::Module& m) {
    return dynamic_cast<const BlockImpl*>(&m) != nullptr;
  };
  nn::Sequential model = make_model();
  ASSERT_EQ(apply_activation_checkpointing(*model, is_block), 1);
  ASSERT_NE(std::dynamic_pointer_cast<AnyCheckpointWrapperImpl>(model->ptr(3)), nullptr);
  EXPECT_EQ(auto_wrap_paths(model, module_type_policy<BlockImpl>()), Paths{"3"});
  // The block's Linears are the wrapper's members now, not entries: refused.
  EXPECT_TRUE(
      contains(error_of([&] { auto_wrap_paths(model, module_type_policy<nn::LinearImpl>()); }),
               "a typed member of CheckpointWrapper (at 3)"));
  EXPECT_EQ(auto_wrap_paths(model, LambdaPolicy([&](const nn::Module& m, const std::string&,
                                                    int64_t) { return is_block(m); })),
            Paths{"3"});
  EXPECT_EQ(auto_wrap_paths(model, MinParamsPolicy(300)), Paths{"3"});
  // A policy that names the wrapper's type still selects it.
  EXPECT_EQ(auto_wrap_paths(model, module_type_policy<AnyCheckpointWrapperImpl>()), Paths{"3"});
}

// A policy made of an empty std::function is refused when made, naming it:
// an empty LambdaPolicy selected nothing, silently; an empty type test threw
// std::bad_function_call from the walk.
TEST(AutoWrapPolicies, EmptyFunctionsAreRefusedWhenMade) {
  EXPECT_TRUE(contains(error_of([] { LambdaPolicy(nullptr); }),
                       "expected a callable fn, got an empty std::function"));
  EXPECT_TRUE(contains(error_of([] {
                         ModuleTypePolicy({ModuleTypePolicy::Type{"Block", nullptr}});
                       }),
                       "the type 'Block' has an empty matches function"));
  // No types: nothing selected, as PyTorch's ModuleWrapPolicy(set()).
  EXPECT_TRUE(auto_wrap_paths(make_model(), ModuleTypePolicy({})).empty());
}

// MinParamsPolicy never looks inside a MultiheadAttention (PyTorch's
// FORCE_LEAF_MODULES), one in a CheckpointWrapper too (its projections, the
// wrapper's typed members, were selected and refused), nor at the root of
// fully_shard's policy form, which asks about the root as auto_wrap does (a
// projection was made a unit).
TEST(AutoWrapPolicies, MinParamsPolicyNeverLooksInsideAMultiheadAttention) {
  nn::Sequential model(nn::Linear(8, 8), nn::MultiheadAttention(8, 2));
  ASSERT_EQ(apply_activation_checkpointing(
                *model,
                [](const nn::Module& m) { return m.as<nn::MultiheadAttentionImpl>() != nullptr; }),
            1);
  EXPECT_EQ(auto_wrap_paths(model, MinParamsPolicy(0)), Paths{"0"});
  run_ranks_ok(1, [](int, int) {
    const auto group = start_rank();
    auto mha = std::make_shared<nn::MultiheadAttentionImpl>(8, 2);
    fully_shard(*mha, MinParamsPolicy(0));
    EXPECT_EQ(unit_of(*mha->out_proj), nullptr) << "a projection was made a unit";
    EXPECT_NE(unit_of(*mha), nullptr);
    finish_rank(group);
  });
}

// Tied weights between two units the policy selects are refused before any
// unit is made (a review found the first made, then the second refused).
TEST(AutoWrapPolicies, TiedWeightsBetweenSelectedModulesAreRefusedFirst) {
  nn::Linear first(4, 4);
  nn::Sequential tied(first, nn::ReLU(), SharedWeight(first->weight));
  const auto policy = module_type_policy<nn::LinearImpl, SharedWeightImpl>();
  EXPECT_TRUE(contains(error_of([&] { auto_wrap_paths(tied, policy); }),
                       "fsdp(auto_wrap): parameter '2.weight' is the same tensor as a parameter "
                       "of the unit the policy selects at '0'"));
}

TEST(AutoWrapPolicies, AskedInPostOrderWithOnlyUnwrappedParams) {
  std::vector<std::pair<std::string, int64_t>> asked;
  const auto record = [&](bool select_linears) {
    asked.clear();
    return LambdaPolicy(
        [&asked, select_linears](const nn::Module& m, const std::string& path, int64_t numel) {
          asked.emplace_back(path, numel);
          return select_linears && dynamic_cast<const nn::LinearImpl*>(&m) != nullptr;
        });
  };
  const std::vector<std::pair<std::string, int64_t>> all = {{"0", 144},   {"1", 0},   {"2", 32},
                                                            {"3.0", 272}, {"3.1", 0}, {"3.2", 32},
                                                            {"3.3", 272}, {"3", 576}, {"4", 68}};
  EXPECT_TRUE(auto_wrap_paths(make_model(), record(false)).empty());
  EXPECT_EQ(asked, all);
  // Once its Linears are units, the block is left with its LayerNorm's.
  auto expected = all;
  expected[7].second = 32;
  EXPECT_EQ(auto_wrap_paths(make_model(), record(true)), (Paths{"0", "3.0", "3.3", "4"}));
  EXPECT_EQ(asked, expected);
}

TEST(AutoWrapPolicies, SelectingAModuleNoSlotCallsIsRefused) {
  const auto with_mlp = [] { return nn::Sequential(nn::Linear(8, 16), Mlp(), nn::ReLU()); };
  for (const AutoWrapPolicy& policy :
       {AutoWrapPolicy(module_type_policy<nn::LinearImpl>()), AutoWrapPolicy(MinParamsPolicy(200)),
        AutoWrapPolicy(AlwaysWrapPolicy())}) {
    const std::string msg = error_of([&] { auto_wrap_paths(with_mlp(), policy); });
    EXPECT_TRUE(contains(msg, "fsdp(1.fc1)")) << policy.description() << ": " << msg;
    EXPECT_TRUE(contains(msg, "a typed member of ") && contains(msg, "MlpImpl (at 1)")) << msg;
    EXPECT_TRUE(contains(msg, "entry of a torch::nn::Sequential")) << msg;
  }
  // Selecting the entry itself is fine: its unit manages the members.
  EXPECT_EQ(auto_wrap_paths(with_mlp(), module_type_policy<MlpImpl>()), (Paths{"1"}));

  const auto tagged = [] { return nn::Sequential(nn::Linear(8, 16), Tagged()); };
  std::string msg =
      error_of([&] { auto_wrap_paths(tagged(), module_type_policy<nn::LinearImpl>()); });
  EXPECT_TRUE(contains(msg, "fsdp(1.tag)") && contains(msg, "registers besides its entries"))
      << msg;
  // Its entry is wrapped, though the subclass registers another child
  // first (PyTorch wraps any child; libfsdp once refused it).
  const LambdaPolicy entry(
      [](const nn::Module&, const std::string& path, int64_t) { return path == "1.0"; });
  EXPECT_EQ(auto_wrap_paths(tagged(), entry), (Paths{"1.0"}));
  run_ranks_ok(1, [&entry, &tagged](int, int) {
    const auto group = start_rank();
    torch::manual_seed(3);
    nn::Sequential plain = tagged();
    torch::manual_seed(3);
    nn::Sequential model = tagged();
    std::vector<std::string> paths;
    for (const auto& u : auto_wrap(model, entry)) paths.push_back(u.path);
    EXPECT_EQ(paths, (Paths{"1.0"}));
    const torch::Tensor x = torch::randn({3, 8});
    EXPECT_TRUE(torch::allclose(model->forward(x), plain->forward(x)));
    finish_rank(group);
  });

  nn::Linear shared(4, 4);
  nn::Sequential twice(shared, nn::ReLU(), shared);
  msg = error_of([&] { auto_wrap_paths(twice, module_type_policy<nn::LinearImpl>()); });
  EXPECT_TRUE(contains(msg, "fsdp(0)") && contains(msg, "also at 2")) << msg;
}

TEST(AutoWrap, WrapsSelectedEntriesInPlaceKeepingNames) {
  run_ranks_ok(2, [](int, int) {
    const auto group = start_rank();
    for (const auto& c : policy_cases()) {
      nn::Sequential seq = make_model();
      const auto names = names_of(*seq);
      const auto units = auto_wrap(seq, c.policy);
      Paths paths;
      for (const auto& u : units) paths.push_back(u.path);
      EXPECT_EQ(paths, c.expected) << c.name;
      // Each unit sits where its module was, and nothing else became one.
      const auto modules = seq->named_modules();
      for (const auto& u : units) {
        ASSERT_TRUE(modules.contains(u.path)) << c.name << " " << u.path;
        EXPECT_EQ(modules[u.path].get(), u.unit.ptr().get()) << c.name << " " << u.path;
      }
      size_t unit_count = 0;
      for (const auto& m : seq->modules()) unit_count += dynamic_cast<Unit*>(m.get()) ? 1 : 0;
      EXPECT_EQ(unit_count, units.size()) << c.name;
      EXPECT_EQ(names_of(*seq), names) << c.name;
      FullyShardedDataParallel<nn::SequentialImpl> root(seq);
      EXPECT_EQ(names_of(*root), names) << c.name;
      EXPECT_EQ(root->forward(torch::ones({2, 8})).sizes(), (std::vector<int64_t>{2, 4})) << c.name;
    }
    finish_rank(group);
  });
}

// A CustomPolicy's options reach the unit it selects, by auto_wrap and by
// fully_shard's policy form; in a union the first policy that selects a
// module gives its options; a policy that says no changes nothing; options
// fully_shard refuses are refused for one unit too, before any unit is made.
TEST(AutoWrap, ACustomPolicysOptionsReachTheirUnit) {
  run_ranks_ok(1, [](int, int) {
    const auto group = start_rank();
    const auto strategy_at = [](const nn::Sequential& seq, const std::string& path) {
      const Unit* unit = unit_of(*seq->named_modules()[path]);
      return unit == nullptr ? std::string("no unit")
                             : to_string(unit->fsdp_options().sharding_strategy());
    };
    const std::string full = to_string(ShardingStrategy::kFullShard);
    const std::string grad_op = to_string(ShardingStrategy::kShardGradOp);
    nn::Sequential wrapped = make_model();
    auto_wrap(wrapped, linears_inner_first_grad_op());
    EXPECT_EQ(strategy_at(wrapped, "3.0"), grad_op);
    EXPECT_EQ(strategy_at(wrapped, "3.3"), full);
    EXPECT_EQ(strategy_at(wrapped, "0"), full);

    nn::Sequential in_place = make_model();
    const CustomPolicy norms_no_shard(
        [](const nn::Module& m, const std::string&, int64_t, FSDPOptions& o) {
          o.sharding_strategy(ShardingStrategy::kNoShard);  // changed, then refused: must not stick
          return m.as<nn::LayerNormImpl>() != nullptr;
        });
    fully_shard(*in_place, linears_inner_first_grad_op() | norms_no_shard);
    EXPECT_EQ(strategy_at(in_place, "3.0"), grad_op);
    EXPECT_EQ(strategy_at(in_place, "0"), full);
    EXPECT_EQ(strategy_at(in_place, "2"), to_string(ShardingStrategy::kNoShard));
    EXPECT_EQ(strategy_at(in_place, ""), full) << "a policy's change reached the root";

    nn::Sequential refused = make_model();
    const std::string error = error_of([&] {
      fully_shard(*refused, CustomPolicy([](const nn::Module& m, const std::string& path, int64_t,
                                            FSDPOptions& o) {
        o.activation_checkpointing(path == "3.3");
        return m.as<nn::LinearImpl>() != nullptr;
      }));
    });
    EXPECT_TRUE(contains(error, "expected FSDPOptions::activation_checkpointing off")) << error;
    EXPECT_EQ(unit_of(*refused->ptr(0)), nullptr) << "a unit was made before the refusal";
    EXPECT_TRUE(contains(error_of([] { CustomPolicy(nullptr); }),
                         "expected a callable fn, got an empty std::function"));
    // The checks made before any unit read each unit's own options: a unit
    // of frozen and trainable parameters without use_orig_params, ignored
    // modules of its own.
    nn::Sequential mixed = make_model();
    mixed->ptr(3)->as<BlockImpl>()->ptr(0)->as<nn::LinearImpl>()->bias.set_requires_grad(false);
    const CustomPolicy flat_at_3_0(
        [](const nn::Module& m, const std::string& path, int64_t, FSDPOptions& o) {
          if (path == "3.0") o.use_orig_params(false);
          return m.as<nn::LinearImpl>() != nullptr;
        });
    const std::string frozen =
        error_of([&] { auto_wrap(mixed, flat_at_3_0, FSDPOptions().use_orig_params(true)); });
    EXPECT_TRUE(contains(frozen, "when use_orig_params=false")) << frozen;
    EXPECT_EQ(unit_of(*mixed->ptr(0)), nullptr) << "a unit was made before the refusal";
    const auto own_ignored = mixed->ptr(4);
    const std::string ignored = error_of([&] {
      fully_shard(*mixed, CustomPolicy([&](const nn::Module& m, const std::string&, int64_t,
                                           FSDPOptions& o) {
        o.ignored_modules({own_ignored});
        return m.as<nn::LinearImpl>() != nullptr;
      }));
    });
    EXPECT_TRUE(contains(ignored, "fully_shard's policy changed ignored_modules for the unit at 0"))
        << ignored;
    EXPECT_EQ(unit_of(*mixed->ptr(0)), nullptr) << "a unit was made before the refusal";
    finish_rank(group);
  });
}

// Trains 3 SGD steps, wrapped by `policy` on this rank's block of the global
// batch, or plain on all of it (policy null); returns the full parameters
// (gathered when wrapped) after each step.
std::vector<ParamSnapshot> train(const AutoWrapPolicy* policy, bool pass_through = false) {
  const int world = rank_and_world().second;
  nn::Sequential seq = make_model(pass_through);
  torch::manual_seed(1);
  const torch::Tensor batch = batch_for(torch::randn({4 * world, 8}), policy != nullptr);
  const torch::Tensor target = batch_for(torch::randn({4 * world, 4}), policy != nullptr);
  std::function<torch::Tensor(torch::Tensor)> forward = [&](torch::Tensor x) {
    return seq->forward(x);
  };
  std::vector<torch::Tensor> params = seq->parameters();
  FullyShardedDataParallel<nn::SequentialImpl> root{nullptr};
  if (policy != nullptr) {
    auto_wrap(seq, *policy);
    root = FullyShardedDataParallel<nn::SequentialImpl>(seq);
    forward = [&](torch::Tensor x) { return root->forward(x); };
    params = root->parameters();
  }
  torch::optim::SGD optimizer(params, torch::optim::SGDOptions(0.1).momentum(0.9));
  std::vector<ParamSnapshot> history;
  for (int step = 0; step < 3; ++step) {
    optimizer.zero_grad();
    nn::functional::mse_loss(forward(batch), target).backward();
    optimizer.step();
    std::unique_ptr<SummonFullParams> full;
    if (root) full = std::make_unique<SummonFullParams>(*root.ptr());
    history.push_back(snapshot_params(*seq));
  }
  return history;
}

TEST(AutoWrap, TrainingMatchesPlainLibTorch) {
  for (const int world : parity_world_sizes()) {
    SCOPED_TRACE("world " + std::to_string(world));
    run_ranks_ok(world, [](int, int) {
      const auto group = start_rank();
      const auto expected = train(nullptr);
      for (const auto& c : policy_cases()) expect_same_history(train(&c.policy), expected, c.name);
      finish_rank(group);
    });
  }
}

// fsdp::wrap() outside an EnableWrap scope leaves the module as it is
// (PyTorch's wrap() returns the module itself): auto_wrap sees through such
// pass-through wrappers, selecting and training as without them.
TEST(AutoWrap, PassThroughWrappersAreTheModulesTheyHold) {
  for (const int world : parity_world_sizes()) {
    SCOPED_TRACE("world " + std::to_string(world));
    run_ranks_ok(world, [](int, int) {
      const auto group = start_rank();
      const auto expected = train(nullptr);
      for (const auto& c : policy_cases()) {
        nn::Sequential seq = make_model(/*pass_through=*/true);
        const auto names = names_of(*seq);
        Paths paths;
        for (const auto& u : auto_wrap(seq, c.policy)) paths.push_back(u.path);
        EXPECT_EQ(paths, c.expected) << c.name;
        EXPECT_EQ(names_of(*seq), names) << c.name;
        expect_same_history(train(&c.policy, /*pass_through=*/true), expected, c.name);
      }
      finish_rank(group);
    });
  }
}

TEST(AutoWrap, RefusalsNameTheModuleAndChangeNothing) {
  run_ranks_ok(2, [](int rank, int) {
    const auto group = start_rank();
    const std::string prefix = "[rank " + std::to_string(rank) + "] ";

    // A unit made by hand inside the block: auto_wrap names it, before
    // wrapping the Linears it would otherwise wrap first.
    nn::Sequential seq = make_model();
    nn::Sequential block(std::dynamic_pointer_cast<nn::SequentialImpl>(seq->ptr(3)));
    wrap_sequential_entry(block, 2);
    std::string msg = error_of([&] { auto_wrap(seq, module_type_policy<nn::LinearImpl>()); });
    EXPECT_TRUE(contains(msg, prefix + "fsdp(3.2): expected a module tree without FSDP units"))
        << msg;
    EXPECT_NE(dynamic_cast<nn::LinearImpl*>(seq->ptr(0).get()), nullptr)
        << "entry 0 was wrapped before the refusal";

    // A typed member selected after an entry that could be wrapped.
    nn::Sequential with_mlp(nn::Linear(8, 16), Mlp());
    msg = error_of([&] { auto_wrap(with_mlp, module_type_policy<nn::LinearImpl>()); });
    EXPECT_TRUE(contains(msg, prefix + "fsdp(1.fc1): expected the modules that "
                                       "ModuleTypePolicy(torch::nn::LinearImpl) selects to be "
                                       "Sequential entries"))
        << msg;
    EXPECT_TRUE(contains(msg, "fsdp::FullyShardedDataParallel<Impl>")) << msg;
    EXPECT_NE(dynamic_cast<nn::LinearImpl*>(with_mlp->ptr(0).get()), nullptr)
        << "entry 0 was wrapped before the refusal";

    // A null module among ignored_modules: named before any unit is made.
    nn::Sequential fresh = make_model();
    msg = error_of([&] {
      auto_wrap(fresh, module_type_policy<nn::LinearImpl>(),
                FSDPOptions().ignored_modules({nullptr}));
    });
    EXPECT_TRUE(contains(msg, "expected ignored_modules to hold modules, got a nullptr")) << msg;
    EXPECT_NE(dynamic_cast<nn::LinearImpl*>(fresh->ptr(0).get()), nullptr)
        << "entry 0 was wrapped before the refusal";
    finish_rank(group);
  });
}

}  // namespace test_auto_wrap
}  // namespace fsdp::testing

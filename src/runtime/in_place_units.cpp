// Units made in place by fsdp::fully_shard (see Note [Units made in place]).

#include "runtime/in_place_units.h"

#include <c10/util/Exception.h>

#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "runtime/unit_runtime.h"

namespace fsdp::detail {
namespace {

// Note [Units made in place]
// A module that fully_shard makes a unit keeps its class, its children and
// its parameters' names; nothing in it can hold the unit (LibTorch modules
// have no attribute slots, and a registered child would change
// named_children() and what torch::save writes and torch::load expects). So
// the units live here, keyed by their module, and unit_of() looks here when
// the module is no wrapper. An entry watches its module through a weak_ptr
// (Module derives from enable_shared_from_this): when the module is gone,
// the next fully_shard, or the next use of a unit that module held (Note [A
// model's units outlive it]), frees its unit, whose FlatParameter holds the
// module's parameters. A module not owned by a
// shared_ptr (built on the stack) cannot be watched, and LibTorch's own tree
// walks (modules(), named_modules()) refuse it: fully_shard refuses it too.
class InPlaceUnit final : public Unit {
 public:
  InPlaceUnit(torch::nn::Module& module, FSDPOptions options) : Unit(std::move(options)) {
    init_in_place(module);
  }
};

struct Entry {
  std::weak_ptr<torch::nn::Module> alive;
  torch::nn::Module* module = nullptr;
  std::unique_ptr<Unit> unit;
  bool gone() const { return alive.expired(); }
};

struct Registry {
  std::mutex mutex;
  std::unordered_map<const torch::nn::Module*, Entry> units;
};

Registry& registry() {
  static auto* r = new Registry();  // outlives static modules
  return *r;
}

// Takes the entries of modules that are gone out of the registry; the caller
// destroys them outside the lock.
std::vector<std::unique_ptr<Unit>> take_gone(Registry& r) {
  std::vector<std::unique_ptr<Unit>> out;
  for (auto it = r.units.begin(); it != r.units.end();) {
    if (it->second.gone()) {
      out.push_back(std::move(it->second.unit));
      it = r.units.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

}  // namespace

void release_gone_in_place_units() {
  Registry& r = registry();
  std::vector<std::unique_ptr<Unit>> gone;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    gone = take_gone(r);
  }
  gone.clear();  // outside the lock: a unit's destruction may look up others
}

Unit& make_in_place_unit(torch::nn::Module& module, FSDPOptions options) {
  release_gone_in_place_units();
  Registry& r = registry();
  // Built outside the lock: building may look up other units.
  auto unit = std::make_unique<InPlaceUnit>(module, std::move(options));
  Entry entry;
  entry.alive = module.weak_from_this();
  TORCH_INTERNAL_ASSERT(!entry.alive.expired(), "fsdp: fully_shard of a module without owner");
  entry.module = &module;
  entry.unit = std::move(unit);
  Unit& out = *entry.unit;
  std::lock_guard<std::mutex> lock(r.mutex);
  r.units[&module] = std::move(entry);
  return out;
}

Unit* in_place_unit_of(const torch::nn::Module& module) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (r.units.empty()) return nullptr;
  auto it = r.units.find(&module);
  if (it == r.units.end() || it->second.gone()) return nullptr;
  return it->second.unit.get();
}

UnitRuntime* outermost_in_place_unit(const torch::nn::Module& module) {
  std::vector<std::pair<torch::nn::Module*, Unit*>> candidates;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (auto& [key, entry] : r.units) {
      if (!entry.gone()) candidates.emplace_back(entry.module, entry.unit.get());
    }
  }
  Unit* best = nullptr;
  size_t best_size = 0;
  for (const auto& [m, unit] : candidates) {
    const auto tree = m->modules(/*include_self=*/false);
    bool holds = m == &module;
    for (const auto& sub : tree) holds = holds || sub.get() == &module;
    if (holds && tree.size() + 1 > best_size) {
      best = unit;
      best_size = tree.size() + 1;
    }
  }
  return best != nullptr ? UnitRuntime::of(*best->wrapped_module()) : nullptr;
}

}  // namespace fsdp::detail

#include <fsdp/wrap/enable_wrap.h>

namespace fsdp {

namespace {
thread_local std::optional<FSDPOptions> t_scope;
}  // namespace

EnableWrap::EnableWrap(FSDPOptions options) : previous_(t_scope) { t_scope = std::move(options); }

EnableWrap::~EnableWrap() { t_scope = previous_; }

const FSDPOptions* EnableWrap::current() { return t_scope ? &*t_scope : nullptr; }

}  // namespace fsdp

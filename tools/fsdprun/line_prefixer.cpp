#include "line_prefixer.h"

#include <utility>

namespace fsdp::launch {

LinePrefixer::LinePrefixer(std::string prefix) : prefix_(std::move(prefix)) {}

void LinePrefixer::feed(std::string_view data, std::string* out) {
  while (!data.empty()) {
    const size_t newline = data.find('\n');
    if (newline == std::string_view::npos) {
      partial_.append(data);
      // Release over-long lines in fixed pieces rather than growing forever.
      while (partial_.size() >= kMaxLineBytes) {
        emit(std::string_view(partial_).substr(0, kMaxLineBytes), out);
        partial_.erase(0, kMaxLineBytes);
      }
      return;
    }
    if (partial_.empty()) {
      emit(data.substr(0, newline), out);
    } else {
      partial_.append(data.substr(0, newline));
      emit(partial_, out);
      partial_.clear();
    }
    data.remove_prefix(newline + 1);
  }
}

void LinePrefixer::finish(std::string* out) {
  if (partial_.empty()) return;
  emit(partial_, out);
  partial_.clear();
}

void LinePrefixer::emit(std::string_view line, std::string* out) const {
  out->append(prefix_);
  out->append(line);
  out->push_back('\n');
}

}  // namespace fsdp::launch

#include "line_prefixer.h"

#include <utility>

namespace fsdp::launch {

LinePrefixer::LinePrefixer(std::string prefix) : prefix_(std::move(prefix)) {}

void LinePrefixer::feed(std::string_view data, std::string* out) {
  // A "\r\n" split between two reads: its '\n' ends the line already sent.
  if (std::exchange(ended_at_cr_, false) && !data.empty() && data[0] == '\n') {
    out->push_back('\n');
    data.remove_prefix(1);
  }
  while (!data.empty()) {
    const size_t newline = data.find_first_of("\r\n");
    if (newline == std::string_view::npos) {
      partial_.append(data);
      // Release over-long lines in fixed pieces rather than growing forever.
      while (partial_.size() >= kMaxLineBytes) {
        emit(std::string_view(partial_).substr(0, kMaxLineBytes), out);
        partial_.erase(0, kMaxLineBytes);
      }
      return;
    }
    const bool crlf = data.compare(newline, 2, "\r\n") == 0;
    const std::string_view ending = data.substr(newline, crlf ? 2 : 1);
    if (partial_.empty()) {
      emit(data.substr(0, newline), out, ending);
    } else {
      partial_.append(data.substr(0, newline));
      emit(partial_, out, ending);
      partial_.clear();
    }
    data.remove_prefix(newline + ending.size());
    ended_at_cr_ = data.empty() && ending == "\r";
  }
}

void LinePrefixer::finish(std::string* out) {
  if (partial_.empty() && !mid_line_) return;
  emit(partial_, out);
  partial_.clear();
}

void LinePrefixer::flush_partial(std::string* out) {
  if (partial_.empty()) return;
  if (!mid_line_) out->append(prefix_);
  out->append(partial_);
  partial_.clear();
  mid_line_ = true;
}

void LinePrefixer::emit(std::string_view line, std::string* out, std::string_view ending) {
  if (!std::exchange(mid_line_, false)) out->append(prefix_);
  out->append(line);
  out->append(ending);
}

namespace {

/// Python's Template identifier: [_a-zA-Z][_a-zA-Z0-9]*.
bool identifier_char(char c, bool first) {
  const bool letter = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
  return letter || (!first && c >= '0' && c <= '9');
}

}  // namespace

std::string expand_prefix_template(const std::string& text,
                                   const std::map<std::string, std::string>& values) {
  std::string out;
  size_t i = 0;
  while (i < text.size()) {
    if (text[i] != '$' || i + 1 == text.size()) {
      out += text[i++];
      continue;
    }
    if (text[i + 1] == '$') {
      out += '$';
      i += 2;
      continue;
    }
    const bool braced = text[i + 1] == '{';
    const size_t start = i + (braced ? 2 : 1);
    size_t end = start;
    while (end < text.size() && identifier_char(text[end], end == start)) ++end;
    const bool closed = !braced || (end < text.size() && text[end] == '}');
    const auto it = values.find(text.substr(start, end - start));
    if (end == start || !closed || it == values.end()) {
      out += text[i++];  // not a placeholder it knows: kept as written
      continue;
    }
    out += it->second;
    i = end + (braced ? 1 : 0);
  }
  return out;
}

}  // namespace fsdp::launch

#include "memory/block_cache.h"

#include <c10/util/Exception.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iterator>

#include "detail/error.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define FSDP_POISON(p, n) ASAN_POISON_MEMORY_REGION((p), (n))
#define FSDP_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#define FSDP_POISON(p, n) ((void)(p), (void)(n))
#define FSDP_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

namespace fsdp::detail {
namespace {

size_t page_rounded(size_t bytes) {
  static const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}

char* map_pages(size_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : static_cast<char*>(p);
}

}  // namespace

void* BlockCache::take(size_t bytes, size_t& block_bytes) {
  const size_t want = page_rounded(bytes);
  block_bytes = want;
  std::lock_guard<std::mutex> lock(mutex_);
  // Best fit: the smallest free range that is large enough (the lowest
  // address among equals); split off what is not needed.
  const auto fit = by_size_.lower_bound({want, nullptr});
  if (fit != by_size_.end()) {
    char* data = fit->second;
    const size_t range_bytes = fit->first;
    erase_free(by_addr_.find(data));
    if (range_bytes > want) {
      insert_free(data + want, range_bytes - want);
      ++stats_.split;
    }
    ++stats_.reused;
    in_use_ += want;
    peak_in_use_ = std::max(peak_in_use_, in_use_);
    FSDP_UNPOISON(data, want);
    return data;
  }
  // New memory, within the bound of Note [CPU block cache].
  const size_t peak = std::max(peak_in_use_, in_use_ + want);
  const size_t limit = peak + peak / 16;
  while (!by_age_.empty() && in_use_ + cached_ + want > limit) evict_oldest();
  char* data = map_pages(want);
  if (data == nullptr) {  // the free ranges may be what is in the way
    while (!by_age_.empty()) evict_oldest();
    data = map_pages(want);
  }
  const int err = errno;
  TORCH_CHECK(data != nullptr, error_prefix(-1, "cpu memory"), "could not allocate ", bytes,
              " bytes: ", std::strerror(err),
              ". The process is out of memory: shard the model over more ranks, or use a smaller "
              "batch or model");
  ++stats_.mapped;
  in_use_ += want;
  peak_in_use_ = std::max(peak_in_use_, in_use_);
  return data;
}

void BlockCache::give_back(void* data, size_t block_bytes) {
  FSDP_POISON(data, block_bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  in_use_ -= block_bytes;
  char* begin = static_cast<char*>(data);
  size_t bytes = block_bytes;
  // Merge with the free neighbours on both sides.
  auto next = by_addr_.lower_bound(begin);
  if (next != by_addr_.end() && next->first == begin + bytes) {
    bytes += next->second.bytes;
    next = std::next(next);
    erase_free(std::prev(next));
  }
  if (next != by_addr_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second.bytes == begin) {
      begin = prev->first;
      bytes += prev->second.bytes;
      erase_free(prev);
    }
  }
  insert_free(begin, bytes);
}

void BlockCache::insert_free(char* data, size_t bytes) {
  const uint64_t age = next_age_++;
  by_addr_.emplace(data, Range{bytes, age});
  by_size_.emplace(bytes, data);
  by_age_.emplace(age, data);
  cached_ += bytes;
}

void BlockCache::erase_free(std::map<char*, Range>::iterator it) {
  by_size_.erase({it->second.bytes, it->first});
  by_age_.erase(it->second.age);
  cached_ -= it->second.bytes;
  by_addr_.erase(it);
}

void BlockCache::evict_oldest() {
  char* data = by_age_.begin()->second;
  const auto it = by_addr_.find(data);
  const size_t bytes = it->second.bytes;
  erase_free(it);
  FSDP_UNPOISON(data, bytes);
  ::munmap(data, bytes);  // a free range may span several mappings: munmap takes any pages
  ++stats_.evicted;
}

void BlockCache::release_cached() {
  std::lock_guard<std::mutex> lock(mutex_);
  while (!by_age_.empty()) evict_oldest();
}

int64_t BlockCache::cached_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(cached_);
}

BlockCache::Stats BlockCache::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  Stats out = stats_;
  out.peak_in_use = static_cast<int64_t>(peak_in_use_);
  out.mapped_bytes = static_cast<int64_t>(in_use_ + cached_);
  out.cached_bytes = static_cast<int64_t>(cached_);
  return out;
}

}  // namespace fsdp::detail

#include "job_token.h"

#include <sys/random.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

namespace fsdp::launch {

namespace {

constexpr const char* kVariable = "FSDP_JOB_TOKEN";

}  // namespace

std::string random_job_token(std::string* error) {
  uint8_t bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t r = ::getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      *error = std::string("getrandom failed: ") + std::strerror(errno);
      return "";
    }
    got += static_cast<size_t>(r);
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string token;
  for (const uint8_t b : bytes) {
    token += kHex[b >> 4];
    token += kHex[b & 15];
  }
  return token;
}

std::string random_run_id(std::string* error) {
  std::string hex = random_job_token(error);
  if (hex.empty()) return "";
  hex[12] = '4';                  // the version
  hex[16] = "89ab"[hex[16] % 4];  // the variant: binary 10xx
  return hex.substr(0, 8) + "-" + hex.substr(8, 4) + "-" + hex.substr(12, 4) + "-" +
         hex.substr(16, 4) + "-" + hex.substr(20);
}

std::string ensure_job_token(const LaunchOptions& options, std::vector<std::string>* env,
                             std::string* error) {
  const std::string prefix = std::string(kVariable) + "=";
  for (auto it = env->begin(); it != env->end(); ++it) {
    if (it->compare(0, prefix.size(), prefix) != 0) continue;
    if (it->size() > prefix.size()) return it->substr(prefix.size());
    env->erase(it);  // set but empty: as if unset
    break;
  }
  if (options.nnodes > 1) {
    // A Python program's ranks meet through torch.distributed's store, which
    // reads no token, and the static backend has no rendezvous of fsdprun's
    // to guard: torchrun's command line works unchanged.
    if (!options.assigns_node_ranks() && !options.python_script.empty()) return "";
    *error = "--nnodes " + std::to_string(options.nnodes) +
             " needs FSDP_JOB_TOKEN, the same on every node: run `export "
             "FSDP_JOB_TOKEN=$(openssl rand -hex 16)` once and start fsdprun with it on each node";
    return "";
  }
  const std::string token = random_job_token(error);
  if (!token.empty()) env->push_back(prefix + token);
  return token;
}

}  // namespace fsdp::launch

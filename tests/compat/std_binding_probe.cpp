// The detector's control (tests/compat/std_bindings.sh): a program that uses
// std::filesystem and links LibTorch the way CMake does by default, without
// libfsdp's link options (Note [libstdc++ before LibTorch]). With a wheel
// that exports std::filesystem from libtorch.so (2.11) its references bind
// into LibTorch, which the detector must report. It never calls them unless
// asked: with such a wheel the call crashes.
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>

int main(int argc, char** argv) {
  if (argc > 2 && std::strcmp(argv[1], "--remove-all") == 0) {
    std::error_code ec;
    std::filesystem::create_directories(std::string(argv[2]) + "/a", ec);
    std::printf("removed %d\n", static_cast<int>(std::filesystem::remove_all(argv[2], ec)));
  }
  return 0;
}

#pragma once

// Files and directories through POSIX calls, never C++17's filesystem library.
//
// Note [No filesystem library]
// PyTorch's wheels from 2.5 on (2.11's among them) export the symbols of the
// filesystem library of the libstdc++ they link statically
// (pytorch/pytorch#133437). A program that links libtorch before libstdc++
// binds filesystem::remove_all and its kin to libtorch.so's copies, which
// crash (a jump to address 0): every checkpoint save did. So nothing libfsdp
// builds (library, tools, examples, tests) uses that library; the library and
// its tests use these helpers, which depend on nothing but libc (tests that do
// not link libfsdp compile this file in). Errors are reported as
// std::error_code, as the overloads they replace did.

#include <cstdint>
#include <string>
#include <system_error>
#include <vector>

namespace fsdp::detail {

/// Removes `path` and, for a directory (not a link to one), everything in it
/// (filesystem::remove_all). A missing `path` is no error. Stops at the
/// first failure, which it leaves in `ec`.
void remove_tree(const std::string& path, std::error_code& ec);
/// Removes a file, a link or an empty directory (filesystem::remove). A
/// missing `path` is no error.
void remove_entry(const std::string& path, std::error_code& ec);
/// Creates `path` and its missing parents (mkdir -p, mode 0777 & ~umask). An
/// existing directory is no error.
void make_dirs(const std::string& path, std::error_code& ec);

/// True when `path` exists (stat: follows links).
bool path_exists(const std::string& path);
/// True when an entry named `path` exists, a dangling link included (lstat).
bool entry_exists(const std::string& path);
/// The size of a file in bytes, or -1 (and `ec`) when it cannot be stat-ed.
int64_t file_size(const std::string& path, std::error_code& ec);

/// The names in directory `dir` (without "." and ".."), in readdir's order;
/// empty (and `ec`) when it cannot be read.
std::vector<std::string> list_dir(const std::string& dir, std::error_code& ec);
/// Every path below `dir` (directories and what they hold, not following
/// links), depth first; what cannot be read is skipped.
std::vector<std::string> walk_tree(const std::string& dir);
/// Copies `from` to `to`: a directory with everything in it (regular files,
/// directories and links, as links), or one file. `to` must not exist.
void copy_tree(const std::string& from, const std::string& to, std::error_code& ec);

/// `path` with "." and empty components dropped and "dir/.." folded, as
/// filesystem::path::lexically_normal (without its trailing separator:
/// "a/b/" gives "a/b"); "." for an empty result of a relative path.
std::string lexically_normal(const std::string& path);

}  // namespace fsdp::detail

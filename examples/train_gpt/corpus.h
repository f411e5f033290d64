#pragma once

// The text a run trains on, as token ids: a file (--data) or the generated
// default corpus, its character vocabulary, and the train / held-out split.

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace train_gpt {

/// English-like text from a small fixed grammar, `chars` characters long
/// (cut at a sentence end). A pure function of `seed`: every rank, build and
/// platform makes the same text, so the default run needs no download.
std::string generate_default_corpus(int64_t chars, uint64_t seed);

/// Characters <-> token ids: the distinct bytes of the text, sorted.
class CharVocab {
 public:
  /// The vocabulary of `text` (which must not be empty).
  explicit CharVocab(const std::string& text);
  /// Number of distinct characters.
  int64_t size() const { return static_cast<int64_t>(chars_.size()); }
  /// Token ids of `text`; throws naming the first character not in the vocabulary.
  std::vector<int64_t> encode(const std::string& text) const;
  /// The character of token `id`.
  char decode(int64_t id) const { return chars_.at(static_cast<size_t>(id)); }

 private:
  std::string chars_;     // id -> character
  std::vector<int> ids_;  // byte -> id, -1 when absent
};

/// A corpus ready to train on: token ids split into a training head and a
/// held-out tail.
struct Corpus {
  std::string source;  ///< The file name, or "generated corpus".
  int64_t chars = 0;   ///< Length of the whole text.
  CharVocab vocab{" "};
  at::Tensor train;  ///< int64 [n_train]
  at::Tensor val;    ///< int64 [n_val]
};

/// Reads `path` (or generates the default corpus when it is empty), builds
/// the vocabulary and splits off the last `val_fraction` for evaluation.
/// Throws std::runtime_error with a message for the user when the file
/// cannot be read, is empty, or either split is too short for sequences of
/// `seq_len` characters (which need seq_len + 1 characters for the targets).
Corpus load_corpus(const std::string& path, int64_t generated_chars, double val_fraction,
                   int64_t seq_len, uint64_t seed);

}  // namespace train_gpt

#include "corpus.h"

#include <array>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace train_gpt {
namespace {

// splitmix64: a tiny PRNG whose output is fixed by its definition, unlike
// std::uniform_int_distribution, which differs between standard libraries.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  template <size_t N>
  const char* pick(const std::array<const char*, N>& words) {
    return words[next() % N];
  }

 private:
  uint64_t state_;
};

// Note [Default corpus]
// A char-level model needs text with structure at several scales: spelling,
// agreement within a phrase, sentence shapes, paragraphs. A dozen sentence
// templates over small word lists give that, and the loss of a good model
// falls well below a unigram model's within a minute of training. The text is
// made at run time (a few milliseconds), so nothing has to be downloaded or
// kept in the repository.
constexpr std::array<const char*, 12> kNames = {"Anna",  "Ben",   "Clara", "David", "Ella", "Felix",
                                                "Grace", "Henry", "Iris",  "Jack",  "Lena", "Max"};
constexpr std::array<const char*, 16> kNouns = {
    "cat",   "dog",  "bird",   "farmer", "child",  "teacher", "horse", "sailor",
    "baker", "king", "friend", "fox",    "doctor", "girl",    "boy",   "painter"};
constexpr std::array<const char*, 14> kAdjectives = {"old",   "young",  "quiet",  "happy",  "small",
                                                     "brave", "tired",  "clever", "kind",   "lazy",
                                                     "proud", "gentle", "busy",   "curious"};
constexpr std::array<const char*, 14> kVerbsPast = {
    "walked", "ran",     "looked", "waited", "slept",  "sang",    "worked",
    "played", "laughed", "rested", "danced", "talked", "hurried", "wandered"};
constexpr std::array<const char*, 12> kVerbsTransitive = {
    "saw",     "found", "carried", "painted", "followed", "helped",
    "visited", "liked", "watched", "called",  "fed",      "met"};
constexpr std::array<const char*, 10> kPlaces = {"garden", "river", "market", "forest",  "village",
                                                 "house",  "hill",  "road",   "harbour", "field"};
constexpr std::array<const char*, 8> kPrepositions = {"to",    "into",   "near", "across",
                                                      "along", "behind", "past", "around"};
constexpr std::array<const char*, 10> kAdverbs = {"slowly", "quickly", "happily",  "quietly",
                                                  "again",  "alone",   "together", "early",
                                                  "late",   "gladly"};
constexpr std::array<const char*, 8> kTimes = {"In the morning", "At night",      "After lunch",
                                               "On Sunday",      "In the spring", "Every day",
                                               "Before dawn",    "That evening"};
constexpr std::array<const char*, 6> kThings = {"a red apple", "an old map",  "a small boat",
                                                "a warm coat", "a blue book", "a wooden box"};

std::string sentence(SplitMix64& r) {
  std::ostringstream s;
  switch (r.next() % 10) {
    case 0:
      s << "The " << r.pick(kAdjectives) << " " << r.pick(kNouns) << " " << r.pick(kVerbsPast)
        << " " << r.pick(kPrepositions) << " the " << r.pick(kPlaces) << ".";
      break;
    case 1:
      s << r.pick(kNames) << " " << r.pick(kVerbsTransitive) << " the " << r.pick(kAdjectives)
        << " " << r.pick(kNouns) << " and " << r.pick(kVerbsPast) << " " << r.pick(kAdverbs) << ".";
      break;
    case 2:
      s << r.pick(kTimes) << ", the " << r.pick(kNouns) << " " << r.pick(kVerbsPast) << " "
        << r.pick(kAdverbs) << ".";
      break;
    case 3:
      s << "When the " << r.pick(kNouns) << " " << r.pick(kVerbsPast) << ", " << r.pick(kNames)
        << " " << r.pick(kVerbsPast) << " " << r.pick(kPrepositions) << " the " << r.pick(kPlaces)
        << ".";
      break;
    case 4:
      s << "Did the " << r.pick(kNouns) << " see " << r.pick(kNames) << " near the "
        << r.pick(kPlaces) << "?";
      break;
    case 5:
      s << r.pick(kNames) << " and " << r.pick(kNames) << " " << r.pick(kVerbsPast) << " "
        << r.pick(kPrepositions) << " the " << r.pick(kPlaces) << " " << r.pick(kAdverbs) << ".";
      break;
    case 6:
      s << "\"Look at " << r.pick(kThings) << "!\" said " << r.pick(kNames) << ".";
      break;
    case 7:
      s << "The " << r.pick(kNouns) << " was " << r.pick(kAdjectives) << ", but the "
        << r.pick(kNouns) << " was " << r.pick(kAdjectives) << ".";
      break;
    case 8:
      s << r.pick(kNames) << " gave the " << r.pick(kNouns) << " " << r.pick(kThings) << ".";
      break;
    default:
      s << "There was a " << r.pick(kAdjectives) << " " << r.pick(kNouns) << " in the "
        << r.pick(kPlaces) << ".";
      break;
  }
  return s.str();
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open --data file '" + path + "'");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw std::runtime_error("cannot read --data file '" + path + "'");
  return text.str();
}

at::Tensor to_tensor(const std::vector<int64_t>& ids) { return at::tensor(ids, at::kLong); }

}  // namespace

std::string generate_default_corpus(int64_t chars, uint64_t seed) {
  SplitMix64 r(seed);
  std::string text;
  text.reserve(static_cast<size_t>(chars) + 200);
  while (static_cast<int64_t>(text.size()) < chars) {
    // Paragraphs of 3 to 6 sentences.
    const uint64_t n = 3 + r.next() % 4;
    for (uint64_t i = 0; i < n; ++i) {
      if (i > 0) text += ' ';
      text += sentence(r);
    }
    text += "\n\n";
  }
  return text;
}

CharVocab::CharVocab(const std::string& text) : ids_(256, -1) {
  if (text.empty()) throw std::runtime_error("the text is empty");
  std::array<bool, 256> seen{};
  for (unsigned char c : text) seen[c] = true;
  for (int b = 0; b < 256; ++b) {
    if (!seen[b]) continue;
    ids_[b] = static_cast<int>(chars_.size());
    chars_ += static_cast<char>(b);
  }
}

std::vector<int64_t> CharVocab::encode(const std::string& text) const {
  std::vector<int64_t> out;
  out.reserve(text.size());
  for (unsigned char c : text) {
    if (ids_[c] < 0) {
      std::ostringstream msg;
      msg << "character '" << static_cast<char>(c) << "' (byte " << static_cast<int>(c)
          << ") does not occur in the training text";
      throw std::runtime_error(msg.str());
    }
    out.push_back(ids_[c]);
  }
  return out;
}

Corpus load_corpus(const std::string& path, int64_t generated_chars, double val_fraction,
                   int64_t seq_len, uint64_t seed) {
  Corpus corpus;
  const std::string text =
      path.empty() ? generate_default_corpus(generated_chars, seed) : read_file(path);
  corpus.source = path.empty() ? "generated corpus" : path;
  if (text.empty()) throw std::runtime_error("--data file '" + path + "' is empty");
  corpus.chars = static_cast<int64_t>(text.size());
  corpus.vocab = CharVocab(text);
  const auto n_val = static_cast<int64_t>(static_cast<double>(corpus.chars) * val_fraction);
  const int64_t n_train = corpus.chars - n_val;
  // Each sequence needs seq_len inputs plus one more character for the last target.
  if (n_val < seq_len + 1 || n_train < seq_len + 1) {
    std::ostringstream msg;
    msg << "--seq-len " << seq_len << " needs at least " << seq_len + 1
        << " characters in both the training part and the held-out part of " << corpus.source
        << ", but it has " << corpus.chars << " characters: " << n_train << " for training, "
        << n_val << " held out (--val-fraction " << val_fraction
        << "). Use a shorter --seq-len or a longer text.";
    throw std::runtime_error(msg.str());
  }
  const std::vector<int64_t> ids = corpus.vocab.encode(text);
  const at::Tensor all = to_tensor(ids);
  corpus.train = all.slice(0, 0, n_train).clone();
  corpus.val = all.slice(0, n_train).clone();
  return corpus;
}

}  // namespace train_gpt

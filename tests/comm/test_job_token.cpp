// The job token (Note [Job token]): the handshake itself; a rank with another
// token cannot join, with an error naming the mismatch; hostile connections
// to the store and to a direct-link listener (silent, garbage, a wrong token,
// a huge length prefix, a stalled sender, many at once) are refused, counted
// and logged once, while the job goes on with correct results.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "comm/direct_links.h"
#include "comm_test_util.h"
#include "detail/posix_files.h"
#include "multi_rank.h"
#include "rendezvous/job_token.h"
#include "rendezvous/socket.h"
#include "rendezvous/tcp_store.h"

namespace fsdp::testing {
namespace test_job_token {

using Clock = std::chrono::steady_clock;

constexpr const char* kLogPhrase = "did not present this job's token";

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Waits (up to `limit`) until this process has refused `target` connections.
uint64_t wait_for_refusals(uint64_t target, std::chrono::seconds limit) {
  const auto deadline = Clock::now() + limit;
  while (detail::refused_connections() < target && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return detail::refused_connections();
}

// Opens every kind of hostile connection to host:port and returns how many;
// the silent and stalled ones are kept open in `held` (the server must close
// them after kHandshakeTimeout without waiting for them).
int knock(const std::string& host, int port, std::vector<detail::UniqueFd>* held) {
  auto open = [&] { return detail::connect_tcp(host, port, std::chrono::seconds(5)); };
  auto send = [](const detail::UniqueFd& fd, const std::vector<uint8_t>& b) {
    detail::write_all(fd.get(), b.data(), b.size());
  };
  int made = 0;
  open();  // connects and closes without a byte
  ++made;
  held->push_back(open());  // silent, kept open
  ++made;
  std::mt19937 rng(5);
  for (int i = 0; i < 3; ++i, ++made) {  // garbage
    std::vector<uint8_t> junk(1 + rng() % 300);
    for (auto& b : junk) b = static_cast<uint8_t>(rng());
    send(open(), junk);
  }
  send(open(), detail::handshake_bytes("not this job's token"));  // a wrong token
  ++made;
  auto huge = detail::handshake_bytes("");
  huge[8] = huge[9] = huge[10] = huge[11] = 0xff;  // token length 4 GiB
  send(open(), huge);
  ++made;
  held->push_back(open());  // a few bytes of a right handshake, then a stall
  send(held->back(), std::vector<uint8_t>(huge.begin(), huge.begin() + 5));
  ++made;
  // Many at once: a wrong token each, all open together.
  std::vector<detail::UniqueFd> many;
  for (int i = 0; i < 64; ++i, ++made) many.push_back(open());
  for (auto& fd : many) send(fd, detail::handshake_bytes("x" + std::to_string(made)));
  for (auto& fd : many) held->push_back(std::move(fd));
  return made;
}

TEST(JobToken, HandshakeReaderAcceptsOnlyTheTokenAndReadsNoFurther) {
  auto run = [](const std::vector<uint8_t>& sent, const std::string& token) {
    int sv[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    detail::UniqueFd a(sv[0]), b(sv[1]);
    std::vector<uint8_t> with_more = sent;
    with_more.push_back(42);  // the connection's own protocol starts here
    detail::write_all(a.get(), with_more.data(), with_more.size());
    a.reset();
    detail::HandshakeReader reader;
    while (reader.read_some(b.get(), token) == detail::HandshakeReader::State::kReading) {
    }
    uint8_t next = 0;
    const bool more = ::recv(b.get(), &next, 1, 0) == 1 && next == 42;
    return std::make_pair(reader, more);
  };
  using State = detail::HandshakeReader::State;
  auto [ok, rest] = run(detail::handshake_bytes("secret"), "secret");
  EXPECT_EQ(ok.state(), State::kAccepted);
  EXPECT_TRUE(rest) << "the reader consumed bytes past the handshake";
  EXPECT_EQ(run(detail::handshake_bytes(""), "").first.state(), State::kAccepted);
  EXPECT_EQ(run(detail::handshake_bytes("secreT"), "secret").first.refusal(),
            "it presented a different token");
  EXPECT_EQ(run(detail::handshake_bytes("secret"), "").first.state(), State::kRefused);
  EXPECT_EQ(run(detail::handshake_bytes(""), "secret").first.state(), State::kRefused);
  EXPECT_EQ(run(bytes("GET / HTTP/1.0\r\n\r\n"), "").first.refusal(),
            "it sent bytes that are not libfsdp's handshake");
  auto huge = detail::handshake_bytes("");
  huge[11] = 0x7f;
  EXPECT_NE(run(huge, "").first.refusal().find("exceeds 256"), std::string::npos);
  auto v2 = detail::handshake_bytes("");
  v2[6] = 2;
  EXPECT_NE(run(v2, "").first.refusal().find("version 2"), std::string::npos);
  EXPECT_EQ(run({}, "").first.refusal(), "it closed mid-handshake");  // one byte, then EOF
}

TEST(JobToken, StoreClientWithAnotherTokenFailsNamingTheMismatch) {
  TcpStore server("127.0.0.1", 0, true, std::chrono::seconds(5), "", std::string("ours"));
  const uint64_t before = detail::refused_connections();
  TcpStore stranger("127.0.0.1", server.port(), false, std::chrono::seconds(5), "",
                    std::string("theirs"));
  const auto t0 = Clock::now();
  try {
    stranger.set("k", bytes("v"));
    FAIL() << "a client with another token was served";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("FSDP_JOB_TOKEN differs from the job's"), std::string::npos) << msg;
  }
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(2));
  EXPECT_EQ(wait_for_refusals(before + 1, std::chrono::seconds(5)), before + 1);
  TcpStore member("127.0.0.1", server.port(), false, std::chrono::seconds(5), "",
                  std::string("ours"));
  member.set("k", bytes("v"));
  EXPECT_EQ(server.get("k"), bytes("v"));
  EXPECT_FALSE(server.check({"never"}));
}

TEST(JobToken, HostileConnectionsToTheStoreAreRefusedAndCounted) {
  TcpStore server("127.0.0.1", 0, true, std::chrono::seconds(10), "", std::string("t0k3n"));
  TcpStore member("127.0.0.1", server.port(), false, std::chrono::seconds(10), "",
                  std::string("t0k3n"));
  const uint64_t before = detail::refused_connections();
  std::vector<detail::UniqueFd> held;
  const int made = knock("127.0.0.1", server.port(), &held);
  // Served meanwhile, at once: the held connections hold nothing up.
  const auto t0 = Clock::now();
  member.set("k", bytes("v"));
  EXPECT_EQ(member.get("k"), bytes("v"));
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(1));
  // The stalled and silent ones go after kHandshakeTimeout; the rest at once.
  EXPECT_GE(wait_for_refusals(before + made - 2, std::chrono::seconds(3)), before + made - 2);
  EXPECT_EQ(wait_for_refusals(before + made, std::chrono::seconds(10)), before + made);
  for (auto& fd : held) {  // every one of them is closed by now, "JTNO" said to wrong tokens
    std::string got;
    char b = 0;
    while (got.size() < 16 && ::recv(fd.get(), &b, 1, MSG_DONTWAIT) == 1) got += b;
    EXPECT_TRUE(got.empty() || got == "JTNO") << got;
    EXPECT_EQ(::recv(fd.get(), &b, 1, MSG_DONTWAIT), 0) << "still open";
  }
  EXPECT_EQ(member.add("n", 2), 2);
}

// Two ranks on threads set up direct links while strangers knock on rank 0's
// listener first (its port read from the store, as only a token holder can).
TEST(JobToken, HostileConnectionsToADirectLinkListenerAreRefusedDuringSetUp) {
  const std::string token = "links";
  constexpr auto kTimeout = std::chrono::seconds(20);
  TcpStore server("127.0.0.1", 0, true, kTimeout, "", token);
  const int port = server.port();
  const uint64_t before = detail::refused_connections();
  int made = 0;
  std::vector<detail::UniqueFd> held;
  std::thread stranger([&] {
    TcpStore s("127.0.0.1", port, false, kTimeout, "", token);
    const auto addr = s.get("direct/0");
    const std::string text(addr.begin(), addr.end());
    made = knock("127.0.0.1", std::stoi(text.substr(text.rfind(' ') + 1)), &held);
    s.set("go", bytes("1"));
  });
  std::vector<float> got(2, -1.0f);
  std::vector<std::string> errors(2);
  std::vector<int> listener_port(2, 0);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    ranks.emplace_back([&, rank] {
      try {
        TcpStore s("127.0.0.1", port, false, kTimeout, "", token);
        if (rank == 1) s.get("go");  // after the strangers are queued on rank 0's listener
        detail::DirectLinks links(s, rank, 2, "127.0.0.1", kTimeout, 1 << 16, token);
        const auto addr = s.get("direct/" + std::to_string(rank));
        const std::string text(addr.begin(), addr.end());
        listener_port[rank] = std::stoi(text.substr(text.rfind(' ') + 1));
        for (int i = 0; i < 20; ++i) {
          at::Tensor in = at::full({1000}, static_cast<float>(rank * 100 + i));
          at::Tensor out = at::empty({1000});
          auto recv = links.irecv(out, 1 - rank, i);
          links.isend(in, 1 - rank, i)->wait();
          recv->wait();
          got[rank] = out[999].item<float>();
          if (got[rank] != static_cast<float>((1 - rank) * 100 + i)) break;
        }
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  stranger.join();
  for (auto& t : ranks) t.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  EXPECT_EQ(got[0], 119.0f);
  EXPECT_EQ(got[1], 19.0f);
  // Every stranger was refused, those mid-handshake when set-up ended too.
  EXPECT_EQ(wait_for_refusals(before + made, std::chrono::seconds(10)), before + made);
  // After set-up nothing listens there any more.
  EXPECT_THROW(detail::connect_tcp("127.0.0.1", listener_port[0], std::chrono::milliseconds(300)),
               c10::Error);
}

TEST(JobToken, SharedTokenFromTheOptionsJoinsAndWinsOverTheVariable) {
  run_ranks_ok(2, [](int rank, int world) {
    // Different variables on the two ranks: the option decides.
    setenv("FSDP_JOB_TOKEN", rank == 0 ? "zero" : "one", 1);
    auto pg = init_process_group(ProcessGroupOptions()
                                     .timeout(std::chrono::seconds(20))
                                     .job_token("from-the-options")
                                     .set_default(false));
    at::Tensor t = at::full({4}, static_cast<float>(rank + 1));
    pg->all_reduce(t).wait();
    EXPECT_EQ(t[0].item<float>(), 3.0f);
    (void)world;
  });
}

TEST(JobToken, RankWithAnotherTokenCannotJoin) {
  const auto outcomes = run_ranks(
      2,
      [](int rank, int) {
        if (rank == 1) setenv("FSDP_JOB_TOKEN", "another job's", 1);
        const auto t0 = Clock::now();
        std::string msg;
        try {
          join(Backend::kGloo, std::chrono::seconds(4));
        } catch (const c10::Error& e) {
          msg = e.what_without_backtrace();
        }
        std::cout << "got: " << msg << std::endl;
        if (rank == 1) {
          EXPECT_NE(msg.find("FSDP_JOB_TOKEN differs from the job's"), std::string::npos) << msg;
          EXPECT_LT(Clock::now() - t0, std::chrono::seconds(2));
        } else {  // waits for rank 1 in vain, then fails cleanly
          EXPECT_NE(msg, "");
          EXPECT_LT(Clock::now() - t0, std::chrono::seconds(15));
        }
      },
      MultiRankOptions{
          std::chrono::seconds(40), std::chrono::seconds(20), {{"FSDP_JOB_TOKEN", "this job's"}}});
  expect_all_succeeded(outcomes);
  ASSERT_EQ(outcomes.size(), 2u);
  EXPECT_EQ(count_of(outcomes[0].output, kLogPhrase), 1u) << describe(outcomes[0]);
}

TEST(JobToken, TwoRankJobRunsCollectivesWhileStrangersKnockOnTheStore) {
  const auto outcomes = run_ranks(
      2,
      [](int rank, int world) {
        auto pg = join(Backend::kGloo, std::chrono::seconds(30));
        std::atomic<bool> knocking{rank == 1};
        std::atomic<int> made{0};
        std::vector<detail::UniqueFd> held;
        std::thread stranger;
        if (rank == 1) {
          stranger = std::thread([&] {
            for (int round = 0; round < 3; ++round) {
              made += knock("127.0.0.1", std::atoi(std::getenv("MASTER_PORT")), &held);
            }
            knocking = false;
          });
        }
        at::Tensor flat = at::zeros({world * 256});
        int steps = 0;
        for (;; ++steps) {  // collectives until rank 1 has finished knocking
          pg->all_gather_into_tensor(flat, at::full({256}, static_cast<float>(rank + steps)))
              .wait();
          ASSERT_EQ(flat[300].item<float>(), static_cast<float>(1 + steps));
          at::Tensor big = at::full({1 << 18}, static_cast<float>(rank + 1));  // 1 MiB
          pg->all_reduce(big).wait();
          ASSERT_EQ(big[12345].item<float>(), 3.0f);
          at::Tensor still = at::full({1}, knocking ? 1.0f : 0.0f);
          pg->all_reduce(still).wait();
          if (still.item<float>() == 0.0f) break;
        }
        if (stranger.joinable()) stranger.join();
        at::Tensor count = at::full({1}, static_cast<float>(made.load()));
        pg->broadcast(count, 1).wait();
        // The store still serves: a sub-group's rendezvous goes through it.
        auto sub = pg->new_subgroup({0, 1});
        ASSERT_NE(sub, nullptr);
        sub->barrier().wait();
        if (rank == 0) {
          const auto expected = static_cast<uint64_t>(count.item<float>());
          EXPECT_EQ(wait_for_refusals(expected, std::chrono::seconds(15)), expected);
          std::cout << "refused " << detail::refused_connections() << " connections during "
                    << steps << " steps" << std::endl;
        }
        pg->barrier().wait();
      },
      MultiRankOptions{
          std::chrono::seconds(90), std::chrono::seconds(20), {{"FSDP_JOB_TOKEN", "knock-knock"}}});
  expect_all_succeeded(outcomes);
  ASSERT_EQ(outcomes.size(), 2u);
  EXPECT_EQ(count_of(outcomes[0].output, kLogPhrase), 1u) << describe(outcomes[0]);
  EXPECT_EQ(count_of(outcomes[1].output, kLogPhrase), 0u) << describe(outcomes[1]);
}

// TCP ports this process listens on (from /proc: its socket inodes in LISTEN).
std::set<int> listening_ports_of_this_process() {
  std::set<std::string> inodes;
  std::error_code ec;
  for (const std::string& fd : detail::list_dir("/proc/self/fd", ec)) {
    char target[256];
    const ssize_t n = ::readlink(("/proc/self/fd/" + fd).c_str(), target, sizeof(target));
    const std::string link(target, n > 0 ? static_cast<size_t>(n) : 0);
    if (link.rfind("socket:[", 0) == 0) inodes.insert(link.substr(8, link.size() - 9));
  }
  std::set<int> ports;
  for (const char* table : {"/proc/self/net/tcp", "/proc/self/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >>
          timeout >> inode;
      if (state == "0A" && inodes.count(inode) > 0) {
        ports.insert(std::stoi(local.substr(local.rfind(':') + 1), nullptr, 16));
      }
    }
  }
  return ports;
}

// Gloo's own listeners (LibTorch 1.13 builds) cannot carry the handshake.
// Debian's Gloo (2022-05) opens a listening socket per pair only while that
// pair connects, after the (guarded) store rendezvous, and closes it once
// connected. Here a stranger in each rank scans the rank's own listening
// ports (from /proc, as a port scan would, but faster) and connects to every
// new one. Observed: when the stranger wins the race the pair takes it for
// the peer, the real peer is refused and set-up fails at once; otherwise the
// job joins. Either way set-up must never hang, and after a set-up nothing of
// Gloo's listens. What happened is printed, for docs/communication.md.
TEST(JobToken, HostileConnectionsToTheGlooListener) {
  if (!backend_available(Backend::kC10dGloo)) {
    GTEST_SKIP() << "this build has no Gloo (pip's torch wheel): the direct links carry everything";
  }
  const auto outcomes = run_ranks(
      2,
      [](int rank, int) {
        const int store_port = std::atoi(std::getenv("MASTER_PORT"));
        std::atomic<bool> done{false};
        std::vector<detail::UniqueFd> held;
        std::set<int> knocked;
        std::thread stranger([&] {
          while (!done) {
            for (int port : listening_ports_of_this_process()) {
              if (port == store_port || !knocked.insert(port).second) continue;
              try {
                held.push_back(detail::connect_tcp("127.0.0.1", port, std::chrono::seconds(1)));
                const std::string junk = "not gloo, not fsdp";
                detail::write_all(held.back().get(), junk.data(), junk.size());
              } catch (const c10::Error&) {  // gone already
              }
            }
            std::this_thread::sleep_for(std::chrono::microseconds(200));
          }
        });
        if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(500));
        const auto t0 = Clock::now();
        std::string outcome = "joined";
        try {
          auto pg = init_process_group(ProcessGroupOptions()
                                           .timeout(std::chrono::seconds(5))
                                           .direct_link_bytes(0)  // everything over Gloo
                                           .shared_memory(false)
                                           .set_default(false));
          std::set<int> left = listening_ports_of_this_process();
          left.erase(store_port);
          EXPECT_TRUE(left.empty()) << "a listener outlived set-up, port " << *left.begin();
          at::Tensor t = at::full({1 << 16}, static_cast<float>(rank + 1));
          pg->all_reduce(t).wait();
          outcome = "joined, all_reduce gave " + std::to_string(t[0].item<float>());
        } catch (const c10::Error& e) {
          outcome = std::string("failed: ") + e.what_without_backtrace();
        }
        const auto ms =
            std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
        done = true;
        stranger.join();
        // What became of the strangers: still open (Gloo holds them), closed or reset.
        int open = 0, closed = 0;
        for (auto& fd : held) {
          char b = 0;
          const ssize_t r = ::recv(fd.get(), &b, 1, MSG_DONTWAIT);
          (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) ? open : closed) += 1;
        }
        std::cout << "gloo listener: rank " << rank << " knocked on " << knocked.size()
                  << " port(s) (" << open << " still open, " << closed
                  << " closed or reset); after " << ms << " ms " << outcome << std::endl;
        EXPECT_LT(ms, 15000) << "set-up hung past the timeout";
      },
      MultiRankOptions{
          std::chrono::seconds(60), std::chrono::seconds(30), {{"FSDP_JOB_TOKEN", "gloo"}}});
  expect_all_succeeded(outcomes);
  for (const auto& o : outcomes) {
    std::istringstream lines(o.output);
    for (std::string line; std::getline(lines, line);) {
      if (line.find("gloo listener") != std::string::npos) std::cout << line << "\n";
    }
  }
}

}  // namespace test_job_token
}  // namespace fsdp::testing

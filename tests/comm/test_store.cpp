// TcpStore: the c10d::Store contract, timeouts with clear errors, and
// concurrent clients, in one process (server and clients on threads); the
// server on the address clients dial, bounded requests, and a server that
// shrugs off silent, garbage and many connections (Note [Store server]).

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/join_store.h"
#include "rendezvous/job_token.h"
#include "rendezvous/tcp_store.h"

#include "comm_test_util.h"
#include "detail/posix_files.h"
#include "rendezvous/socket.h"

namespace fsdp {
namespace test_store {

using Clock = std::chrono::steady_clock;

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

int threads_of_this_process() {
  std::error_code ec;
  return static_cast<int>(detail::list_dir("/proc/self/task", ec).size());
}

// A connected socket to 127.0.0.1:port.
detail::UniqueFd raw_connection(int port) {
  return detail::connect_tcp("127.0.0.1", port, std::chrono::seconds(5));
}

TEST(TcpStore, SetGetAddCheckDeleteCompareSet) {
  TcpStore server("127.0.0.1", 0, true, std::chrono::seconds(5));
  ASSERT_GT(server.port(), 0);
  TcpStore client("127.0.0.1", server.port(), false, std::chrono::seconds(5));
  client.set("a", bytes("hello"));
  EXPECT_EQ(server.get("a"), bytes("hello"));
  EXPECT_EQ(server.add("n", 5), 5);
  EXPECT_EQ(client.add("n", -2), 3);
  EXPECT_EQ(client.get("n"), bytes("3"));  // counters are text, as in c10d
  EXPECT_TRUE(client.check({"a", "n"}));
  EXPECT_FALSE(client.check({"a", "missing"}));
  EXPECT_EQ(client.getNumKeys(), 2);
  EXPECT_EQ(client.compareSet("a", bytes("wrong"), bytes("x")), bytes("hello"));
  EXPECT_EQ(client.compareSet("a", bytes("hello"), bytes("x")), bytes("x"));
  EXPECT_EQ(client.compareSet("new", {}, bytes("v")), bytes("v"));
  EXPECT_TRUE(client.deleteKey("a"));
  EXPECT_FALSE(client.deleteKey("a"));
  std::vector<uint8_t> big(3 << 20, 7);
  client.set("big", big);
  EXPECT_EQ(server.get("big"), big);
}

TEST(TcpStore, GetWaitsForAKeySetLater) {
  TcpStore server("127.0.0.1", 0, true, std::chrono::seconds(10));
  std::thread setter([port = server.port()] {
    TcpStore c("127.0.0.1", port, false, std::chrono::seconds(10));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    c.set("late", bytes("v"));
  });
  TcpStore waiter("127.0.0.1", server.port(), false, std::chrono::seconds(10));
  waiter.wait({"late"});
  EXPECT_EQ(waiter.get("late"), bytes("v"));
  setter.join();
}

TEST(TcpStore, TimeoutIsAClearError) {
  TcpStore server("127.0.0.1", 0, true, std::chrono::milliseconds(300));
  const auto t0 = std::chrono::steady_clock::now();
  try {
    server.get("never");
    FAIL() << "get of a missing key returned";
  } catch (const c10::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'never'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("timed out"), std::string::npos) << msg;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
  EXPECT_THROW(server.wait({"never"}, std::chrono::milliseconds(100)), c10::Error);
}

TEST(TcpStore, ManyConcurrentClientsCount) {
  TcpStore server("127.0.0.1", 0, true, std::chrono::seconds(10));
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([port = server.port()] {
      TcpStore c("127.0.0.1", port, false, std::chrono::seconds(10));
      for (int i = 0; i < 100; ++i) c.add("count", 1);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(server.add("count", 0), 800);
}

TEST(TcpStore, ClientOfAMissingServerFailsInTime) {
  const auto t0 = std::chrono::steady_clock::now();
  try {
    TcpStore c("127.0.0.1", 1, false, std::chrono::milliseconds(300));
    FAIL() << "connected to a port nobody listens on";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot reach the rendezvous store"), std::string::npos)
        << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
}

TEST(TcpStore, LostServerIsAClearError) {
  auto server = std::make_unique<TcpStore>("127.0.0.1", 0, true, std::chrono::seconds(5));
  TcpStore client("127.0.0.1", server->port(), false, std::chrono::seconds(5));
  server.reset();
  try {
    client.set("k", bytes("v"));
    FAIL() << "set succeeded without a server";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("lost the connection"), std::string::npos) << e.what();
  }
}

// A rank that found rank 0's store keeps the whole timeout for each request
// after, as c10d's TCPStore does, not what was left of it when it connected.
TEST(TcpStore, AJoiningRankKeepsTheWholeTimeout) {
  TcpStore server("127.0.0.1", 0, true, std::chrono::seconds(5));
  RankInfo info;
  info.rank = 1;
  info.world_size = 2;
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  auto store =
      detail::join_store("127.0.0.1", server.port(), info, std::chrono::seconds(3), "", "");
  EXPECT_EQ(store->getTimeout(), std::chrono::milliseconds(3000));
}

// A name that does not resolve (yet: a Kubernetes service whose pod is not
// up) is tried again until the timeout, then named in the error.
TEST(TcpStore, AHostNameNotResolvedIsTriedUntilTheTimeout) {
  const auto t0 = Clock::now();
  try {
    TcpStore c("rank0-not-up.invalid", 29500, false, std::chrono::milliseconds(500));
    FAIL() << "connected to a name that does not resolve";
  } catch (const c10::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("cannot reach the rendezvous store"), std::string::npos) << msg;
    EXPECT_NE(msg.find("cannot resolve 'rank0-not-up.invalid'"), std::string::npos) << msg;
  }
  EXPECT_GE(Clock::now() - t0, std::chrono::milliseconds(400));
}

// milliseconds::max() is a wait without end, not one that overflowed into
// the past.
TEST(TcpStore, AWaitWithoutEndAnswersWhenTheKeyComes) {
  TcpStore server("127.0.0.1", 0, true, std::chrono::milliseconds::max());
  std::thread setter([port = server.port()] {
    TcpStore c("127.0.0.1", port, false, std::chrono::milliseconds::max());
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    c.set("k", bytes("v"));
  });
  TcpStore waiter("127.0.0.1", server.port(), false, std::chrono::seconds(10));
  waiter.wait({"k"}, std::chrono::milliseconds::max());
  EXPECT_EQ(server.get("k"), bytes("v"));
  setter.join();
}

// A value the server would refuse is refused by the client, naming its size,
// not reported as a lost rank 0; the connection stays usable.
TEST(TcpStore, AValueOverTheLimitIsRefusedNamingItsSize) {
  TcpStore server("127.0.0.1", 0, true, std::chrono::seconds(10));
  TcpStore client("127.0.0.1", server.port(), false, std::chrono::seconds(10));
  try {
    client.set("big", std::vector<uint8_t>(size_t{1} << 30));
    FAIL() << "a 1 GiB value was sent";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("is over its limit"), std::string::npos) << e.what();
  }
  client.set("small", bytes("v"));
  EXPECT_EQ(server.get("small"), bytes("v"));
}

TEST(TcpStore, ServerListensOnTheLoopbackAddressClientsDial) {
  std::vector<std::string> hosts = {"127.0.0.2", "localhost"};
  if (testing::have_ipv6_loopback()) hosts.push_back("::1");
  for (const auto& host : hosts) {
    TcpStore server(host, 0, true, std::chrono::seconds(5));
    TcpStore client(host, server.port(), false, std::chrono::seconds(2));
    client.set("k", bytes(host));
    EXPECT_EQ(server.get("k"), bytes(host)) << host;
  }
  if (!testing::have_ipv6_loopback()) GTEST_SKIP() << "no IPv6 loopback: ::1 not tested";
}

TEST(TcpStore, SilentServerIsAnErrorNamingItWithinTheTimeout) {
  // Accepts (the kernel completes connections in its backlog) but never answers.
  int port = 0;
  detail::UniqueFd silent = detail::listen_tcp("127.0.0.1", 0, &port);
  TcpStore client("127.0.0.1", port, false, std::chrono::milliseconds(500));
  const auto t0 = Clock::now();
  try {
    client.set("k", bytes("v"));
    FAIL() << "a request to a silent server returned";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("127.0.0.1:" + std::to_string(port)), std::string::npos) << msg;
    EXPECT_NE(msg.find("did not answer within 500 ms"), std::string::npos) << msg;
  }
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(3));
  // The stream is out of step now: later requests fail at once, with the cause.
  const auto t1 = Clock::now();
  try {
    client.get("k");
    FAIL() << "a request after a failed one returned";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("did not answer"), std::string::npos);
  }
  // (Under the 500 ms that waiting for an answer would take, however loaded
  // the machine.)
  EXPECT_LT(Clock::now() - t1, std::chrono::milliseconds(500));
  // get() may wait for its key up to the timeout, and the server's answer gets
  // 2 s more: it is bounded by that.
  TcpStore waiter("127.0.0.1", port, false, std::chrono::milliseconds(500));
  const auto t2 = Clock::now();
  EXPECT_THROW(waiter.get("k"), c10::Error);
  EXPECT_LT(Clock::now() - t2, std::chrono::seconds(4));
}

TEST(TcpStore, SilentGarbageAndManyConnectionsLeaveTheServerServingWithOneThread) {
  TcpStore server("127.0.0.1", 0, true, std::chrono::seconds(10));
  const int port = server.port();
  const int threads_before = threads_of_this_process();
  std::vector<detail::UniqueFd> held;
  for (int i = 0; i < 300; ++i) held.push_back(raw_connection(port));  // silent
  std::mt19937 rng(7);
  for (int i = 0; i < 50; ++i) {  // random bytes, often an absurd length
    detail::UniqueFd fd = raw_connection(port);
    std::vector<uint8_t> junk(1 + rng() % 300);
    for (auto& b : junk) b = static_cast<uint8_t>(rng());
    detail::write_all(fd.get(), junk.data(), junk.size());
    if (i % 2 == 0) held.push_back(std::move(fd));
  }
  {  // after the handshake, a well-framed request that does not parse: answered kBadRequest
    detail::UniqueFd fd = raw_connection(port);
    const auto hello = detail::handshake_bytes(detail::resolve_job_token(""));
    detail::write_all(fd.get(), hello.data(), hello.size());
    const uint8_t frame[] = {3, 0, 0, 0, 0 /* kSet */, 9, 9};
    detail::write_all(fd.get(), frame, sizeof(frame));
    uint8_t ack[detail::kHandshakeAckBytes] = {};
    ASSERT_TRUE(detail::read_all(fd.get(), ack, sizeof(ack)));
    uint8_t reply[5] = {};
    ASSERT_TRUE(detail::read_all(fd.get(), reply, sizeof(reply)));
    EXPECT_EQ(reply[0], 1);  // length 1
    EXPECT_EQ(reply[4], 2);  // StoreStatus::kBadRequest
  }
  {  // a frame longer than any message: closed
    detail::UniqueFd fd = raw_connection(port);
    const auto hello = detail::handshake_bytes(detail::resolve_job_token(""));
    detail::write_all(fd.get(), hello.data(), hello.size());
    uint8_t ack[detail::kHandshakeAckBytes] = {};
    ASSERT_TRUE(detail::read_all(fd.get(), ack, sizeof(ack)));
    const uint8_t frame[] = {0xff, 0xff, 0xff, 0xff, 1, 2, 3};
    detail::write_all(fd.get(), frame, sizeof(frame));
    uint8_t b = 0;
    EXPECT_FALSE(detail::read_all(fd.get(), &b, 1));
  }
  for (int i = 0; i < 2000; ++i) raw_connection(port);  // connect and close at once
  // A real client is served while all that is held open.
  TcpStore client("127.0.0.1", port, false, std::chrono::seconds(5));
  client.set("k", bytes("v"));
  EXPECT_EQ(client.get("k"), bytes("v"));
  EXPECT_EQ(threads_of_this_process(), threads_before) << "the server made threads per connection";
}

TEST(TcpStore, ParkedRequestsOfManyClientsAreAnsweredByOneSet) {
  TcpStore server("127.0.0.1", 0, true, std::chrono::seconds(10));
  std::vector<std::thread> waiters;
  std::atomic<int> got{0};
  for (int t = 0; t < 16; ++t) {
    waiters.emplace_back([&, port = server.port()] {
      TcpStore c("127.0.0.1", port, false, std::chrono::seconds(10));
      if (c.get("go") == bytes("now")) ++got;
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  server.set("go", bytes("now"));
  for (auto& t : waiters) t.join();
  EXPECT_EQ(got.load(), 16);
}

}  // namespace test_store
}  // namespace fsdp

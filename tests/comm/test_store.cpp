// TcpStore: the c10d::Store contract, timeouts with clear errors, and
// concurrent clients, in one process (server and clients on threads).

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fsdp/comm/tcp_store.h>

namespace fsdp {
namespace {

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

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

}  // namespace
}  // namespace fsdp

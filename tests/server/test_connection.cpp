// find_socket: the descriptor of a TCP connection, found from its two endpoints as httplib
// reports them. The stream writer writes to it directly, so it must be the right one among
// several connections, and -1 for endpoints that are no connection here.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <vector>

#include "server/connection.h"

namespace recur::server {
namespace {

int port_of(int fd, bool peer) {
  sockaddr_in a{};
  socklen_t len = sizeof(a);
  if (peer) {
    getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len);
  } else {
    getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  }
  return ntohs(a.sin_port);
}

TEST(FindSocket, FindsEachAcceptedConnection) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(listener, 16), 0);
  const int server_port = port_of(listener, false);
  a.sin_port = htons(uint16_t(server_port));

  std::vector<int> clients, accepted;
  for (int i = 0; i < 5; ++i) {
    const int c = socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_EQ(connect(c, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    clients.push_back(c);
    accepted.push_back(accept(listener, nullptr, nullptr));
    ASSERT_GE(accepted.back(), 0);
  }
  for (int i = 0; i < 5; ++i) {
    // The server side of connection i: local = the listening port, remote = client i's port.
    EXPECT_EQ(
        find_socket("127.0.0.1", server_port, "127.0.0.1", port_of(clients[size_t(i)], false)),
        accepted[size_t(i)]);
    // The client side is found the other way round.
    EXPECT_EQ(
        find_socket("127.0.0.1", port_of(clients[size_t(i)], false), "127.0.0.1", server_port),
        clients[size_t(i)]);
  }
  EXPECT_EQ(find_socket("127.0.0.1", server_port, "127.0.0.2", port_of(clients[0], false)), -1);
  EXPECT_EQ(find_socket("127.0.0.1", server_port, "127.0.0.1", 1), -1);
  EXPECT_EQ(find_socket("127.0.0.1", -1, "127.0.0.1", port_of(clients[0], false)), -1);
  for (int fd : clients) close(fd);
  for (int fd : accepted) close(fd);
  close(listener);
}

}  // namespace
}  // namespace recur::server

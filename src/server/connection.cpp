#include "server/connection.h"

#include <dirent.h>
#include <netdb.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace recur::server {

namespace {

// Whether an endpoint is ip:port, with the address formatted as httplib does (getnameinfo
// with NI_NUMERICHOST). The port is compared first: most sockets differ there already.
bool same_endpoint(const sockaddr_storage& addr, socklen_t len, const std::string& ip, int port) {
  int p = -1;
  if (addr.ss_family == AF_INET) {
    p = ntohs(reinterpret_cast<const sockaddr_in&>(addr).sin_port);
  } else if (addr.ss_family == AF_INET6) {
    p = ntohs(reinterpret_cast<const sockaddr_in6&>(addr).sin6_port);
  }
  if (p != port) return false;
  char host[NI_MAXHOST];
  return getnameinfo(reinterpret_cast<const sockaddr*>(&addr), len, host, sizeof(host), nullptr, 0,
                     NI_NUMERICHOST) == 0 &&
         ip == host;
}

bool matches(int fd, const std::string& local_addr, int local_port, const std::string& remote_addr,
             int remote_port) {
  sockaddr_storage addr;
  socklen_t len = sizeof(addr);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return false;
  if (!same_endpoint(addr, len, remote_addr, remote_port)) return false;
  len = sizeof(addr);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return false;
  return same_endpoint(addr, len, local_addr, local_port);
}

bool is_socket(int fd) {
  struct stat st;
  return fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode);
}

}  // namespace

int find_socket(const std::string& local_addr, int local_port, const std::string& remote_addr,
                int remote_port) {
  if (remote_port < 0 || local_port < 0) return -1;
  // A keep-alive connection brings its next request to the same worker thread.
  thread_local int last = -1;
  if (last >= 0 && matches(last, local_addr, local_port, remote_addr, remote_port)) return last;
  DIR* dir = opendir("/proc/self/fd");
  if (!dir) return -1;
  const int self = dirfd(dir);
  int found = -1;
  while (dirent* e = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == self) continue;
    if (is_socket(int(fd)) && matches(int(fd), local_addr, local_port, remote_addr, remote_port)) {
      found = int(fd);
      break;
    }
  }
  closedir(dir);
  if (found >= 0) last = found;
  return found;
}

}  // namespace recur::server

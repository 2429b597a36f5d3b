// The client socket behind an httplib request. httplib 0.11 hands handlers no socket, but a
// TCP connection is identified by its two endpoints, which the request carries; the socket is
// open for as long as the handler runs. Polling it for POLLRDHUP sees a disconnect at once.
#pragma once

#include <string>

namespace recur::server {

// The descriptor whose local and peer endpoints are these, or -1.
int find_socket(const std::string& local_addr, int local_port, const std::string& remote_addr,
                int remote_port);

}  // namespace recur::server

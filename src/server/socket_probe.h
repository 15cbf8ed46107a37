// Client-disconnect detection for HTTP handlers. cpp-httplib 0.11 (Debian's) does not give
// a handler its connection, so we find the handler's socket by its port pair (our local
// port and the client's port, unique among this process's connected sockets) and then
// poll it: a peer that closed or reset the connection shows as POLLRDHUP / HUP / ERR or as
// a readable socket with nothing to read.
#pragma once

namespace spade::server {

// The connected socket with local port `local_port` and peer port `remote_port`, or -1.
// Cached per thread (a keep-alive connection stays on one handler thread).
int find_connection_socket(int local_port, int remote_port);

// True when the peer of `fd` has gone away (never blocks). False for fd < 0.
bool peer_closed(int fd);

}  // namespace spade::server

// For the spare tests: the Python that takes a spare's call off descriptor 3 (run_contract.h),
// places the descriptors that came with it at 1 and 2, and executes the call's argv. The spare
// programs of spare_rank_test.cc and spare_zygote_test.cc run it once they are ready.
#pragma once

namespace fanrun::testing {

constexpr const char* kTakeCallProgram = R"(
import os, socket
channel = socket.socket(fileno=3)
data, fds, _, _ = socket.recv_fds(channel, 65536, 2)
head, _, body = data.partition(b"\n")
assert head.startswith(b"call ")
while len(body) < int(head[5:]):
    body += channel.recv(65536)
channel.detach()
fields = body.split(b"\0")[:-1]
count = int(fields[1])
argv, env = fields[2:2 + count], fields[2 + count:]
os.dup2(fds[0], 1)
os.dup2(fds[1], 2)
if fields[0]:
    os.chdir(fields[0])
os.execve(argv[0], argv, dict(entry.split(b"=", 1) for entry in env))
)";

}  // namespace fanrun::testing

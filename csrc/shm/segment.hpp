// POSIX shared-memory segments: the CPU analog of a CUDA IPC buffer.
//
// Lifetime rule: a segment's name exists in /dev/shm only between its creation and the moment every peer has
// mapped it (Runtime::sync unlinks it then). A process killed inside that window leaves a name whose creator
// pid is dead; cleanup_stale_segments() at the next start removes it. Names carry the uid and creator pid.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <memory>
#include <string>

namespace mtdeepep::shm {

class SharedSegment {
  public:
    // Creates a new segment (mode 0600, O_EXCL) and reserves its pages so that a full /dev/shm fails here
    // with a clear error instead of a SIGBUS on first touch.
    static std::shared_ptr<SharedSegment> create(const std::string& name, size_t num_bytes);
    // Maps a segment created by a peer of the same user.
    static std::shared_ptr<SharedSegment> open(const std::string& name, size_t num_bytes);

    ~SharedSegment();
    SharedSegment(const SharedSegment&) = delete;
    SharedSegment& operator=(const SharedSegment&) = delete;

    // Removes the name from /dev/shm (owner only, idempotent); the mapping stays valid.
    void unlink();

    void* data() const { return data_; }
    size_t size() const { return num_bytes_; }
    const std::string& name() const { return name_; }

  private:
    SharedSegment(std::string name, void* data, size_t num_bytes, bool owner);

    std::string name_;
    void* data_;
    size_t num_bytes_;
    bool owner_;
    bool linked_;
};

// "/mtdeepep-u<uid>-p<pid>-<sequence>-<random>", unique per call.
std::string make_segment_name();

// Unlinks this user's mtdeepep segments whose creator process is gone. Returns how many were removed.
int cleanup_stale_segments();

// True while `pid` runs (zombies count as exited).
bool process_alive(pid_t pid);

}  // namespace mtdeepep::shm

#include "shm/segment.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>

#include "common/exception.hpp"

namespace mtdeepep::shm {

namespace {

const char* kPrefix = "mtdeepep-u";

std::string errno_text(int err) {
    return concat(std::strerror(err), " (errno ", err, ")");
}

void* map_fd(int fd, size_t num_bytes, const std::string& name) {
    // MAP_POPULATE pre-faults the page tables so the first dispatch does not pay for them.
    void* ptr = mmap(nullptr, num_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (ptr == MAP_FAILED) throw CommError(concat("mtdeepep: mmap of ", name, " failed: ", errno_text(errno)));
    return ptr;
}

}  // namespace

SharedSegment::SharedSegment(std::string name, void* data, size_t num_bytes, bool owner)
    : name_(std::move(name)), data_(data), num_bytes_(num_bytes), owner_(owner), linked_(owner) {}

std::shared_ptr<SharedSegment> SharedSegment::create(const std::string& name, size_t num_bytes) {
    int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, S_IRUSR | S_IWUSR);
    if (fd < 0) throw CommError(concat("mtdeepep: shm_open(", name, ") failed: ", errno_text(errno)));
    auto fail = [&](const std::string& what, int err) {
        close(fd);
        shm_unlink(name.c_str());
        throw CommError(concat("mtdeepep: ", what, " for shared segment ", name, " failed: ", errno_text(err)));
    };
    // The umask can only clear bits; fchmod makes the mode exactly 0600 whatever it is.
    if (fchmod(fd, S_IRUSR | S_IWUSR) != 0) fail("fchmod 0600", errno);
    if (ftruncate(fd, static_cast<off_t>(num_bytes)) != 0) fail(concat("ftruncate to ", num_bytes, " bytes"), errno);
    int err = posix_fallocate(fd, 0, static_cast<off_t>(num_bytes));
    if (err != 0) {
        if (err == ENOSPC)
            fail(concat("reserving ", num_bytes, " bytes in /dev/shm (reduce num_nvl_bytes or enlarge /dev/shm)"), err);
        if (err != EOPNOTSUPP && err != EINVAL) fail("posix_fallocate", err);
    }
    void* data = nullptr;
    try {
        data = map_fd(fd, num_bytes, name);
    } catch (...) {
        close(fd);
        shm_unlink(name.c_str());
        throw;
    }
    close(fd);
    return std::shared_ptr<SharedSegment>(new SharedSegment(name, data, num_bytes, true));
}

std::shared_ptr<SharedSegment> SharedSegment::open(const std::string& name, size_t num_bytes) {
    int fd = shm_open(name.c_str(), O_RDWR, 0);
    if (fd < 0) throw CommError(concat("mtdeepep: cannot open peer segment ", name, ": ", errno_text(errno)));
    struct stat st{};
    if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < num_bytes) {
        close(fd);
        throw CommError(concat("mtdeepep: peer segment ", name, " has ", st.st_size, " bytes, expected ", num_bytes,
                               " (ranks disagree on num_nvl_bytes?)"));
    }
    void* data = nullptr;
    try {
        data = map_fd(fd, num_bytes, name);
    } catch (...) {
        close(fd);
        throw;
    }
    close(fd);
    return std::shared_ptr<SharedSegment>(new SharedSegment(name, data, num_bytes, false));
}

void SharedSegment::unlink() {
    if (owner_ && linked_) {
        shm_unlink(name_.c_str());
        linked_ = false;
    }
}

SharedSegment::~SharedSegment() {
    unlink();
    if (data_ != nullptr) munmap(data_, num_bytes_);
}

std::string make_segment_name() {
    static std::atomic<uint64_t> sequence{0};
    std::random_device device;
    uint64_t nonce = (static_cast<uint64_t>(device()) << 32) ^ device();
    return concat("/", kPrefix, getuid(), "-p", getpid(), "-", sequence++, "-", std::hex, nonce);
}

bool process_alive(pid_t pid) {
    if (pid <= 0) return false;
    if (kill(pid, 0) != 0 && errno == ESRCH) return false;
    // A killed child that its parent has not reaped yet still answers kill(); /proc tells it is a zombie.
    std::ifstream stat_file(concat("/proc/", pid, "/stat"));
    if (!stat_file) return true;
    std::string line;
    std::getline(stat_file, line);
    auto paren = line.rfind(')');
    if (paren == std::string::npos || paren + 2 >= line.size()) return true;
    char state = line[paren + 2];
    return state != 'Z' && state != 'X';
}

int cleanup_stale_segments() {
    DIR* dir = opendir("/dev/shm");
    if (dir == nullptr) return 0;
    const std::string mine = concat(kPrefix, getuid(), "-p");
    int removed = 0;
    while (dirent* entry = readdir(dir)) {
        std::string name = entry->d_name;
        if (name.rfind(mine, 0) != 0) continue;
        pid_t pid = static_cast<pid_t>(std::strtol(name.c_str() + mine.size(), nullptr, 10));
        if (!process_alive(pid) && shm_unlink(("/" + name).c_str()) == 0) ++removed;
    }
    closedir(dir);
    return removed;
}

}  // namespace mtdeepep::shm

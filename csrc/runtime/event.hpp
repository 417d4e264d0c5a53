// Completion of work queued on a runtime's comm thread (the CPU counterpart of a CUDA event), and the comm thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "common/exception.hpp"
#include "common/hooks.hpp"

namespace mtdeepep {

// True on the worker thread of a CommStream.
inline bool& comm_thread_flag() {
    static thread_local bool flag = false;
    return flag;
}
inline bool on_comm_thread() {
    return comm_thread_flag();
}

class Event {
  public:
    // What to do when a wait on this event is interrupted (Ctrl-C): the runtime aborts the operation on every rank.
    explicit Event(std::function<void(const std::string&)> on_interrupt = nullptr)
        : on_interrupt_(std::move(on_interrupt)) {}

    // Blocks until the work finished; rethrows its error, if any. Interruptible: a pending Ctrl-C on the Python
    // main thread stops the wait (and the operation, through `on_interrupt`) with Interrupted.
    void wait() {
        std::unique_lock<std::mutex> lock(mutex_);
        while (!done_cv_.wait_for(lock, std::chrono::milliseconds(20), [&] { return done_; })) {
            lock.unlock();
            try {
                poll_interrupt();
            } catch (const Interrupted& interrupted) {
                if (on_interrupt_) on_interrupt_(interrupted.what());
                throw;
            }
            lock.lock();
        }
        if (error_) std::rethrow_exception(error_);
    }
    bool query() {
        std::lock_guard<std::mutex> lock(mutex_);
        return done_;
    }
    void complete(std::exception_ptr error = nullptr) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            done_ = true;
            error_ = error;
        }
        done_cv_.notify_all();
    }

  private:
    std::mutex mutex_;
    std::condition_variable done_cv_;
    bool done_ = false;
    std::exception_ptr error_;
    std::function<void(const std::string&)> on_interrupt_;
};
using EventPtr = std::shared_ptr<Event>;

inline EventPtr completed_event() {
    auto event = std::make_shared<Event>();
    event->complete();
    return event;
}

// One worker thread running tasks in submission order: the CPU counterpart of a comm stream.
//
// The worker owns its queue state through a shared_ptr, so the stream may be destroyed from the worker itself
// (the last reference to a buffer can be dropped by a finishing task): it then detaches instead of joining.
class CommStream {
  public:
    CommStream() : state_(std::make_shared<State>()) {
        worker_ = std::thread([state = state_] {
            comm_thread_flag() = true;
            run(*state);
        });
    }
    ~CommStream() { shutdown(); }
    CommStream(const CommStream&) = delete;
    CommStream& operator=(const CommStream&) = delete;

    void submit(std::function<void()> task) {
        {
            std::lock_guard<std::mutex> lock(state_->mutex);
            ++state_->pending;
            state_->tasks.push_back(std::move(task));
        }
        state_->ready.notify_one();
    }

    // Tasks submitted and not finished yet.
    int pending() const {
        std::lock_guard<std::mutex> lock(state_->mutex);
        return state_->pending;
    }

    // Finishes the queued tasks, then joins the worker (or detaches it, when called from the worker).
    void shutdown() {
        {
            std::lock_guard<std::mutex> lock(state_->mutex);
            state_->stopping = true;
        }
        state_->ready.notify_one();
        if (!worker_.joinable()) return;
        if (worker_.get_id() == std::this_thread::get_id())
            worker_.detach();
        else
            worker_.join();
    }

  private:
    struct State {
        mutable std::mutex mutex;
        std::condition_variable ready;
        std::deque<std::function<void()>> tasks;
        int pending = 0;
        bool stopping = false;
    };

    static void run(State& state) {
        for (;;) {
            std::function<void()> task;
            {
                std::unique_lock<std::mutex> lock(state.mutex);
                state.ready.wait(lock, [&] { return state.stopping || !state.tasks.empty(); });
                if (state.tasks.empty()) return;
                task = std::move(state.tasks.front());
                state.tasks.pop_front();
            }
            task();
            std::lock_guard<std::mutex> lock(state.mutex);
            --state.pending;
        }
    }

    std::shared_ptr<State> state_;
    std::thread worker_;
};

}  // namespace mtdeepep

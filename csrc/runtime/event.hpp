// Completion of work queued on a Runtime's comm thread: the CPU counterpart of a CUDA event.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace mtdeepep {

class Event {
  public:
    // Blocks until the work finished; rethrows its error, if any.
    void wait() {
        std::unique_lock<std::mutex> lock(mutex_);
        done_cv_.wait(lock, [&] { return done_; });
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
};
using EventPtr = std::shared_ptr<Event>;

inline EventPtr completed_event() {
    auto event = std::make_shared<Event>();
    event->complete();
    return event;
}

// One worker thread running tasks in submission order: the CPU counterpart of a comm stream.
class CommStream {
  public:
    CommStream() : worker_([this] { run(); }) {}
    ~CommStream() { shutdown(); }

    void submit(std::function<void()> task) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            tasks_.push_back(std::move(task));
        }
        ready_cv_.notify_one();
    }

    // Finishes the queued tasks, then joins the worker.
    void shutdown() {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stopping_ = true;
        }
        ready_cv_.notify_one();
        if (worker_.joinable()) worker_.join();
    }

  private:
    void run() {
        for (;;) {
            std::function<void()> task;
            {
                std::unique_lock<std::mutex> lock(mutex_);
                ready_cv_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
                if (tasks_.empty()) return;
                task = std::move(tasks_.front());
                tasks_.pop_front();
            }
            task();
        }
    }

    std::mutex mutex_;
    std::condition_variable ready_cv_;
    std::deque<std::function<void()>> tasks_;
    bool stopping_ = false;
    std::thread worker_;
};

}  // namespace mtdeepep

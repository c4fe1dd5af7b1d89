// FileStore on real RocksDB: a model-based test (random puts of sizes across
// chunk boundaries, deletes, lists with paging and purpose filters, reopens,
// against a plain in-memory model, compared after every step), limits and
// validation, tenant isolation, damaged records and chunks reported as
// Corruption, and a crash test: a child process putting and deleting files
// is killed with SIGKILL many times; every acknowledged put is whole after
// reopen, every acknowledged delete is gone, and no file is ever partial.
#include "coordinator/jobs/file_store.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "tests/crash_child.h"
#include "tests/storage/segment_store_test_util.h"

namespace penumbra::jobs {
namespace {

using storage::testing::TempDir;

FileStoreOptions Options(const std::string& path, const int64_t* now = nullptr) {
  FileStoreOptions o;
  o.path = path;
  o.sync_writes = false;
  o.max_file_bytes = 3 * FileStore::kChunkBytes;
  o.max_bytes_per_tenant = 8 * FileStore::kChunkBytes;
  o.max_files_per_tenant = 12;
  if (now != nullptr) o.clock = [now] { return *now; };
  return o;
}

std::unique_ptr<FileStore> OpenOrDie(const FileStoreOptions& o) {
  auto s = FileStore::Open(o);
  CHECK(s.ok()) << s.status();
  return std::move(*s);
}

// Content that differs with its seed everywhere (a swapped chunk shows).
std::string Content(size_t bytes, uint64_t seed) {
  std::string s(bytes, '\0');
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < bytes; i += 8) {
    const uint64_t v = rng();
    std::memcpy(s.data() + i, &v, std::min<size_t>(8, bytes - i));
  }
  return s;
}

struct ModelFile {
  std::string tenant, filename, purpose, content;
  int64_t created_at = 0;
};

TEST(FileStoreTest, MatchesAModelUnderRandomPutsDeletesListsAndReopens) {
  TempDir dir;
  int64_t now = 1000;
  auto store = OpenOrDie(Options(dir.path(), &now));
  std::map<std::string, ModelFile> model;  // by id; ids sort as their creation only by chance, so order by seq below
  std::vector<std::string> order;          // ids in creation order
  std::mt19937_64 rng(7);
  const std::vector<std::string> tenants = {"alpha", "beta"};
  const std::vector<std::string> purposes = {"batch", "user_data"};
  const size_t chunk = FileStore::kChunkBytes;
  const std::vector<size_t> sizes = {0, 1, 17, chunk - 1, chunk, chunk + 1, 2 * chunk + 5};
  auto tenant_use = [&](const std::string& t) {
    int64_t files = 0, bytes = 0;
    for (auto& [id, f] : model) {
      if (f.tenant == t) {
        ++files;
        bytes += static_cast<int64_t>(f.content.size());
      }
    }
    return std::make_pair(files, bytes);
  };
  for (int step = 0; step < 300; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const int op = static_cast<int>(rng() % 10);
    const std::string& tenant = tenants[rng() % tenants.size()];
    now += static_cast<int64_t>(rng() % 3);
    if (op < 5) {
      ModelFile f{tenant, "input-" + std::to_string(step) + ".jsonl", purposes[rng() % 2],
                  Content(sizes[rng() % sizes.size()], step), now};
      auto [files, bytes] = tenant_use(tenant);
      auto put = store->Put(f.tenant, f.filename, f.purpose, f.content);
      if (files + 1 > 12 || bytes + static_cast<int64_t>(f.content.size()) > static_cast<int64_t>(8 * chunk)) {
        ASSERT_EQ(put.status().code(), StatusCode::kResourceExhausted) << put.status();
        continue;
      }
      ASSERT_TRUE(put.ok()) << put.status();
      EXPECT_EQ(put->bytes, static_cast<int64_t>(f.content.size()));
      EXPECT_EQ(put->created_at, now);
      ASSERT_FALSE(model.count(put->id)) << "id " << put->id << " given twice";
      model[put->id] = f;
      order.push_back(put->id);
    } else if (op < 7 && !model.empty()) {
      auto it = model.begin();
      std::advance(it, rng() % model.size());
      const std::string id = it->first;
      if (it->second.tenant != tenant) {
        EXPECT_EQ(store->Delete(tenant, id).code(), StatusCode::kNotFound) << "another tenant's file deleted";
        continue;
      }
      ASSERT_TRUE(store->Delete(tenant, id).ok());
      model.erase(id);
      EXPECT_EQ(store->Get(tenant, id).status().code(), StatusCode::kNotFound);
    } else if (op < 8) {
      store.reset();
      store = OpenOrDie(Options(dir.path(), &now));
    }
    // Compare: every file's info and content, other tenants not seeing it,
    // and each tenant's listing (all purposes and one), page by page.
    for (auto& [id, f] : model) {
      auto info = store->Get(f.tenant, id);
      ASSERT_TRUE(info.ok()) << info.status();
      EXPECT_EQ(info->filename, f.filename);
      EXPECT_EQ(info->purpose, f.purpose);
      EXPECT_EQ(info->created_at, f.created_at);
      const std::string other = f.tenant == "alpha" ? "beta" : "alpha";
      EXPECT_EQ(store->Get(other, id).status().code(), StatusCode::kNotFound);
      EXPECT_EQ(store->Content(other, id).status().code(), StatusCode::kNotFound);
      if (step % 10 == 0) {
        auto c = store->Content(f.tenant, id);
        ASSERT_TRUE(c.ok()) << c.status();
        EXPECT_TRUE(*c == f.content) << "content of " << id << " differs";
      }
    }
    for (const std::string& t : tenants) {
      for (const std::string& purpose : {std::string(), std::string("batch")}) {
        std::vector<std::string> want;
        for (const std::string& id : order) {
          if (model.count(id) && model[id].tenant == t && (purpose.empty() || model[id].purpose == purpose)) {
            want.push_back(id);
          }
        }
        std::vector<std::string> got;
        std::string after;
        for (int pages = 0; pages < 100; ++pages) {
          auto page = store->List(t, after, 3, purpose);
          ASSERT_TRUE(page.ok()) << page.status();
          for (const FileInfo& i : page->files) got.push_back(i.id);
          if (!page->has_more) break;
          ASSERT_FALSE(page->files.empty());
          after = page->files.back().id;
        }
        EXPECT_EQ(got, want) << "tenant " << t << " purpose '" << purpose << "'";
      }
    }
    FileStoreStats st = store->stats();
    EXPECT_EQ(st.files, static_cast<int64_t>(model.size()));
  }
}

TEST(FileStoreTest, RefusesBadInputByName) {
  TempDir dir;
  auto store = OpenOrDie(Options(dir.path()));
  auto no_name = store->Put("alpha", "", "batch", "x");
  EXPECT_EQ(no_name.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(no_name.status().message().find("name"), std::string::npos) << no_name.status();
  EXPECT_EQ(store->Put("alpha", std::string(256, 'n'), "batch", "x").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(store->Put("alpha", "f", "", "x").status().code(), StatusCode::kInvalidArgument);
  auto big = store->Put("alpha", "f", "batch", std::string(3 * FileStore::kChunkBytes + 1, 'x'));
  EXPECT_EQ(big.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(big.status().message().find("max_file_bytes"), std::string::npos) << big.status();
  EXPECT_EQ(store->List("alpha", "file-nothex", 10, "").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(store->List("alpha", "", 0, "").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(store->Get("alpha", "file-0000000000000000").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(store->Delete("alpha", "../etc").code(), StatusCode::kNotFound);
  EXPECT_EQ(store->stats().files, 0);
  FileStoreOptions bad = Options(dir.path() + "/other");
  bad.max_file_bytes = 0;
  EXPECT_EQ(FileStore::Open(bad).status().code(), StatusCode::kInvalidArgument);
}

TEST(FileStoreTest, DamagedChunksAndRecordsAreCorruptionAndOthersStayReadable) {
  TempDir dir;
  auto store = OpenOrDie(Options(dir.path()));
  const std::string a_content = Content(FileStore::kChunkBytes + 100, 1);
  auto a = store->Put("alpha", "a.jsonl", "batch", a_content);
  auto b = store->Put("alpha", "b.jsonl", "batch", Content(50, 2));
  auto c = store->Put("alpha", "c.jsonl", "batch", Content(70, 3));
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  ASSERT_TRUE(store->CorruptForTest(a->id, /*record=*/false).ok());
  auto read = store->Content("alpha", a->id);
  EXPECT_EQ(read.status().code(), StatusCode::kCorruption);
  EXPECT_NE(read.status().message().find(a->id), std::string::npos) << read.status();
  EXPECT_EQ(store->stats().corrupt_records, 1);
  EXPECT_TRUE(store->Content("alpha", b->id).ok());
  // A damaged record shows at the next open: the file is listed as damaged,
  // reads are Corruption, and it can still be deleted.
  ASSERT_TRUE(store->CorruptForTest(b->id, /*record=*/true).ok());
  store.reset();
  store = OpenOrDie(Options(dir.path()));
  EXPECT_EQ(store->Get("alpha", b->id).status().code(), StatusCode::kCorruption);
  EXPECT_EQ(store->stats().corrupt_records, 1);
  EXPECT_TRUE(store->Content("alpha", c->id).ok());
  EXPECT_EQ(store->Delete("alpha", b->id).code(), StatusCode::kCorruption);
  EXPECT_TRUE(store->Delete("alpha", a->id).ok());
  EXPECT_EQ(store->Get("alpha", a->id).status().code(), StatusCode::kNotFound);
}

// ---- SIGKILL ------------------------------------------------------------------
struct Ack {
  enum Kind : uint32_t { kPut = 1, kDeleted = 2 } kind;
  uint32_t n;
  char id[32];
};

FileStoreOptions Durable(const std::string& path) {
  FileStoreOptions o = Options(path);
  o.sync_writes = true;
  o.max_files_per_tenant = 1 << 20;
  o.max_bytes_per_tenant = int64_t{1} << 40;
  return o;
}
size_t SizeFor(uint32_t n) { return (n * 7919u) % (2 * FileStore::kChunkBytes + 3); }

// The child: runs only when re-executed by the crash test. Puts file START,
// START+1, ... (content by number, the number as its name) and deletes
// every third until killed.
TEST(FileStoreCrashChild, Run) {
  const char* dir = std::getenv("PENUMBRA_FILES_CRASH_DIR");
  if (dir == nullptr) GTEST_SKIP() << "only run by FileStoreCrashTest";
  const int fd = std::atoi(std::getenv("PENUMBRA_FILES_CRASH_FD"));
  uint32_t n = static_cast<uint32_t>(std::strtoul(std::getenv("PENUMBRA_FILES_CRASH_START"), nullptr, 10));
  auto opened = FileStore::Open(Durable(dir));
  if (!opened.ok()) _exit(3);
  FileStore& s = **opened;
  for (;; ++n) {
    auto put = s.Put("alpha", std::to_string(n), "batch", Content(SizeFor(n), n));
    if (!put.ok()) _exit(4);
    Ack a{Ack::kPut, n, {}};
    std::memcpy(a.id, put->id.data(), std::min(put->id.size(), sizeof(a.id) - 1));
    if (write(fd, &a, sizeof(a)) != sizeof(a)) _exit(5);
    if (n % 3 == 0) {
      if (!s.Delete("alpha", put->id).ok()) _exit(6);
      a.kind = Ack::kDeleted;
      if (write(fd, &a, sizeof(a)) != sizeof(a)) _exit(5);
    }
  }
}

TEST(FileStoreCrashTest, AcknowledgedPutsAndDeletesSurviveSigkillAndNoFileIsPartial) {
  TempDir dir;
  std::mt19937_64 rng(20261128);
  std::map<uint32_t, std::string> acked;  // n -> id, puts acknowledged
  std::map<uint32_t, bool> deleted;       // deletes acknowledged
  uint32_t next = 1;
  constexpr int kKills = 25;
  for (int kill_no = 0; kill_no < kKills; ++kill_no) {
    SCOPED_TRACE("kill " + std::to_string(kill_no));
    int rd = -1;
    const pid_t pid = ::penumbra::testing::SpawnCrashChild(
        "FileStoreCrashChild.Run",
        {{"PENUMBRA_FILES_CRASH_DIR", dir.path()}, {"PENUMBRA_FILES_CRASH_START", std::to_string(next)}},
        "PENUMBRA_FILES_CRASH_FD", &rd);
    ASSERT_GE(pid, 0);
    Ack a;
    auto take = [&](const Ack& x) {
      if (x.kind == Ack::kPut) acked[x.n] = std::string(x.id);
      if (x.kind == Ack::kDeleted) deleted[x.n] = true;
    };
    ASSERT_EQ(read(rd, &a, sizeof(a)), static_cast<ssize_t>(sizeof(a))) << "the child stopped before its first put";
    take(a);
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 30000));
    const int status = ::penumbra::testing::KillCrashChild(pid);
    ASSERT_EQ(status, -SIGKILL) << "the child ended by itself";
    while (read(rd, &a, sizeof(a)) == sizeof(a)) take(a);
    close(rd);

    auto opened = FileStore::Open(Durable(dir.path()));
    ASSERT_TRUE(opened.ok()) << opened.status();
    FileStore& s = **opened;
    EXPECT_EQ(s.stats().corrupt_records, 0);
    std::map<std::string, FileInfo> present;
    std::string after;
    while (true) {
      auto page = s.List("alpha", after, 1000, "");
      ASSERT_TRUE(page.ok()) << page.status();
      for (const FileInfo& f : page->files) present[f.id] = f;
      if (!page->has_more) break;
      after = page->files.back().id;
    }
    for (auto& [n, id] : acked) {
      if (deleted.count(n)) {
        EXPECT_FALSE(present.count(id)) << "file " << n << " came back after its delete was acknowledged";
      } else if (n % 3 != 0) {  // a multiple of 3 may be deleted without the delete's acknowledgement
        EXPECT_TRUE(present.count(id)) << "acknowledged file " << n << " is lost";
      }
    }
    // Every file there (acknowledged or not) is whole: its content is the
    // one its number names.
    for (auto& [id, f] : present) {
      const uint32_t n = static_cast<uint32_t>(std::stoul(f.filename));
      auto c = s.Content("alpha", id);
      ASSERT_TRUE(c.ok()) << c.status();
      ASSERT_TRUE(*c == Content(SizeFor(n), n)) << "file " << n << " is partial or another's";
      next = std::max(next, n + 1);
    }
    if (!acked.empty()) next = std::max(next, acked.rbegin()->first + 1);
  }
  EXPECT_GT(acked.size(), static_cast<size_t>(kKills)) << "the child acknowledged too little to test anything";
}

}  // namespace
}  // namespace penumbra::jobs

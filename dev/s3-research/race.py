"""Race test: R rounds x N concurrent PUT If-None-Match:* to a fresh key; plus If-Match checks."""
import sys, threading, collections, botocore.session
from botocore.config import Config
from botocore.exceptions import ClientError

endpoint = sys.argv[1]; bucket = sys.argv[2] if len(sys.argv) > 2 else "race"
ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 50; N = 8
ak = sys.argv[4] if len(sys.argv) > 4 else "testkey"; sk = sys.argv[5] if len(sys.argv) > 5 else "testsecret"

def client():
    s = botocore.session.get_session()
    return s.create_client("s3", region_name="us-east-1", endpoint_url=endpoint,
        aws_access_key_id=ak, aws_secret_access_key=sk,
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}, max_pool_connections=4))

def code(e): return e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")

c0 = client()
try: c0.create_bucket(Bucket=bucket)
except ClientError as e: print("create_bucket:", e)

clients = [client() for _ in range(N)]
winners_hist = collections.Counter(); statuses = collections.Counter()
bad_rounds = 0
for r in range(ROUNDS):
    key = f"race/{r}"
    barrier = threading.Barrier(N); res = [None]*N
    def worker(i):
        body = f"writer-{i}".encode() * int(__import__("os").environ.get("REP","64"))
        barrier.wait()
        try:
            clients[i].put_object(Bucket=bucket, Key=key, Body=body, IfNoneMatch="*"); res[i] = 200
        except ClientError as e: res[i] = code(e) or str(e)
        except Exception as e: res[i] = type(e).__name__
    ts = [threading.Thread(target=worker, args=(i,)) for i in range(N)]
    [t.start() for t in ts]; [t.join() for t in ts]
    w = sum(1 for x in res if x == 200); winners_hist[w] += 1; statuses.update(res)
    if w != 1: bad_rounds += 1
print(f"INM race: {ROUNDS} rounds x {N}: rounds with !=1 winner: {bad_rounds}; winners-per-round histogram {dict(winners_hist)}; statuses {dict(statuses)}")

# sequential semantics
k = "cas/obj"
def st(f):
    try: r = f(); return (200, r.get("ETag"))
    except ClientError as e: return (code(e), e.response.get("Error", {}).get("Code"))
print("PUT INM* new:", st(lambda: c0.put_object(Bucket=bucket, Key=k, Body=b"v1", IfNoneMatch="*")))
print("PUT INM* existing:", st(lambda: c0.put_object(Bucket=bucket, Key=k, Body=b"v1b", IfNoneMatch="*")))
e1 = c0.head_object(Bucket=bucket, Key=k)["ETag"]
print("PUT IfMatch current etag:", st(lambda: c0.put_object(Bucket=bucket, Key=k, Body=b"v2", IfMatch=e1)))
print("PUT IfMatch stale etag:", st(lambda: c0.put_object(Bucket=bucket, Key=k, Body=b"v3", IfMatch=e1)))
print("PUT IfMatch on missing key:", st(lambda: c0.put_object(Bucket=bucket, Key="cas/missing", Body=b"x", IfMatch=e1)))
print("body now:", c0.get_object(Bucket=bucket, Key=k)["Body"].read())

# CAS race: N writers each If-Match the same current etag
bad = 0; hist = collections.Counter()
for r in range(ROUNDS):
    cur = c0.head_object(Bucket=bucket, Key=k)["ETag"]
    barrier = threading.Barrier(N); res = [None]*N
    def worker(i):
        barrier.wait()
        try: clients[i].put_object(Bucket=bucket, Key=k, Body=f"r{r}-w{i}".encode(), IfMatch=cur); res[i] = 200
        except ClientError as e: res[i] = code(e)
        except Exception as e: res[i] = type(e).__name__
    ts = [threading.Thread(target=worker, args=(i,)) for i in range(N)]
    [t.start() for t in ts]; [t.join() for t in ts]
    w = sum(1 for x in res if x == 200); hist[w] += 1
    if w != 1: bad += 1
print(f"IfMatch CAS race: {ROUNDS} rounds x {N}: rounds with !=1 winner: {bad}; histogram {dict(hist)}")

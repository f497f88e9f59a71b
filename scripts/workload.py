"""An allocation-heavy Python workload for the benchmark (run with PYTHONMALLOC=malloc so
that every object goes through malloc): builds, serialises, parses, sorts and drops nested
containers and strings. Prints a checksum so that a changed result is noticed."""
import json
import sys


def main(rounds):
    checksum = 0
    for r in range(rounds):
        records = [{"id": i, "name": f"item-{i}-{r}", "tags": [str(i % 7), str(i % 11)], "score": i * 0.5}
                   for i in range(2000)]
        text = json.dumps(records)
        back = json.loads(text)
        back.sort(key=lambda d: (d["tags"][1], -d["id"]))
        words = " ".join(d["name"] for d in back).split("-")
        index = {}
        for w in words:
            index.setdefault(w[:3], []).append(w)
        checksum = (checksum * 31 + len(text) + len(index) + back[0]["id"]) % 1_000_000_007
    print(f"checksum={checksum}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)

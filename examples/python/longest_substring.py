# LeetCode 3, "Longest Substring Without Repeating Characters", published examples.
def length_of_longest_substring(s):
    last = {}
    start = best = 0
    for i, c in enumerate(s):
        if last.get(c, -1) >= start:
            start = last[c] + 1
        last[c] = i
        best = max(best, i - start + 1)
    return best

for s in ["abcabcbb", "bbbbb", "pwwkew"]:
    print(s, length_of_longest_substring(s))

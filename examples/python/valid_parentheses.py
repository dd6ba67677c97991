# LeetCode 20, "Valid Parentheses", published examples.
def is_valid(s):
    pairs = {")": "(", "]": "[", "}": "{"}
    stack = []
    for c in s:
        if c in pairs:
            if not stack or stack.pop() != pairs[c]:
                return False
        else:
            stack.append(c)
    return not stack

for s in ["()", "()[]{}", "(]", "([])"]:
    print(s, is_valid(s))

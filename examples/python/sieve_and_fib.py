# Classic exercises: primes below 50 (sieve of Eratosthenes) and Fibonacci numbers.
def primes_below(n):
    is_p = [True] * n
    is_p[0] = is_p[1] = False
    for i in range(2, int(n ** 0.5) + 1):
        if is_p[i]:
            for j in range(i * i, n, i):
                is_p[j] = False
    return [i for i, p in enumerate(is_p) if p]

def fib(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

print(primes_below(50))
print([fib(i) for i in range(15)])
print(fib(100))
